"""Packaging: `pip install -e .` installs the core; extras mirror requirements/requirements-<extra>.txt."""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))


def requirements(name: str) -> list:
    """The package lines of requirements/<name>.txt (nested -r files are followed)."""
    lines = []
    with open(os.path.join(HERE, "requirements", name), encoding="utf-8") as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line.startswith("-r "):
                lines += requirements(line[3:].strip())
            elif line:
                lines.append(line)
    return lines


EXTRAS = ("sentencepiece", "tiktoken", "data", "triton", "wandb", "tensorboard", "comet", "flashattention", "eval",
          "transformers", "mup", "s3", "dev")

setup(
    name="neox",
    version="0.1.0",
    description="GPT-NeoX-style large language model training on DeepSpeed",
    license="Apache-2.0",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=requirements("requirements.txt"),
    extras_require={extra: requirements(f"requirements-{extra}.txt") for extra in EXTRAS},
)
