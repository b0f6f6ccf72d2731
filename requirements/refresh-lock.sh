#!/usr/bin/env bash
# Refresh requirements/constraints.txt, the lock README's install commands and .ci/run install from: resolve the
# requirements afresh in a new virtual environment and write down exactly what was installed. Run the test suite
# from the new lock before committing it (README, "Run the tests").
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)/venv"
python -m venv "$venv"
"$venv/bin/pip" install -q -e . -r requirements/requirements-dev.txt
{
    echo "# The lock: exact versions of everything 'pip install -e . -r requirements/requirements-dev.txt' installs,"
    echo "# resolved on $(date -u +%Y-%m-%d) with Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())'),"
    echo "# used as constraints by README's install commands and .ci/run (-c requirements/constraints.txt)."
    echo "# Refresh: requirements/refresh-lock.sh. torch's local build label (+cpu, +cu130) is dropped: any build of"
    echo "# the version satisfies it."
    "$venv/bin/pip" freeze --exclude-editable | sed -E 's/^(torch==[^+]+)\+.*/\1/'
} > requirements/constraints.txt
rm -rf "$(dirname "$venv")"
echo "wrote requirements/constraints.txt ($(grep -vc '^#' requirements/constraints.txt) packages)"
