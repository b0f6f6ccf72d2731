"""A pytest fixture that makes directories immutable (chattr +i): neither root nor anyone else can create, rename or
remove a file in them, which permission bits cannot do for root (CI runs as root). Skips where the filesystem or the
container does not allow it."""

import subprocess

import pytest


@pytest.fixture
def immutable():
    """mark(path): set the immutable attribute on ``path``; cleared again after the test."""
    marked = []

    def mark(path):
        result = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"cannot set the immutable attribute here: {result.stderr.strip()}")
        marked.append(path)

    yield mark
    for path in marked:
        subprocess.run(["chattr", "-i", str(path)], check=False)
