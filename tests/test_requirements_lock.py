"""The lock (requirements/constraints.txt) pins every package the requirements name, at a version each requirement
allows: README's install commands (and docs/'s) and .ci/run install from it, so a requirement added without refreshing the lock
(requirements/refresh-lock.sh), or a lock that contradicts a requirement, fails here rather than on a new machine."""
import re
from pathlib import Path
from typing import Dict, List

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"


def requirement_lines(name: str) -> List[str]:
    """The requirement lines of requirements/<name>, following `-r` includes."""
    lines: List[str] = []
    for line in (REQUIREMENTS / name).read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += requirement_lines(line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def locked() -> Dict[str, str]:
    pins = {}
    for line in (REQUIREMENTS / "constraints.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version and re.fullmatch(r"[\w.!+-]+", version), f"constraints.txt: {line!r} is not a pin"
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lock_pins_every_requirement_at_an_allowed_version():
    pins = locked()
    problems = []
    for line in requirement_lines("requirements-dev.txt"):
        requirement = Requirement(line)
        version = pins.get(canonicalize_name(requirement.name))
        if version is None:
            problems.append(f"{requirement.name} is not in the lock")
        elif not requirement.specifier.contains(version, prereleases=True):
            problems.append(f"{requirement.name}=={version} (lock) does not satisfy {line!r}")
    assert not problems, "refresh requirements/constraints.txt (requirements/refresh-lock.sh): " + "; ".join(problems)


def test_readme_and_ci_install_from_the_lock():
    root = REQUIREMENTS.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    installs = [line for line in readme.splitlines() if line.startswith("pip install")]
    assert installs and all("-c requirements/constraints.txt" in line for line in installs), installs
    assert "-c requirements/constraints.txt" in (root / ".ci" / "run").read_text(encoding="utf-8")
