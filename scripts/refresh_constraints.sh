#!/usr/bin/env bash
# Re-resolve every dependency at its newest version, run the whole suite on them, and only
# if it passes, write them to constraints.txt (the versions the README's commands install).
#
# Usage: bash scripts/refresh_constraints.sh [extra pytest args]
#
# Works in a brand-new virtual environment outside the checkout (removed afterwards), so
# nothing installed on this machine leaks into the result. Review `git diff constraints.txt`
# and commit it with the suite's result in the message.
set -euo pipefail
cd "$(dirname "$0")/.."
exec </dev/null
PYTHON=${PYTHON:-python3}
venv=$(mktemp -d "${TMPDIR:-/tmp}/keras-accel-constraints.XXXXXX")
trap 'rm -rf "$venv"' EXIT
"$PYTHON" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
# A new venv's own pip (23.2 on Python 3.11) gives up on the test extra's moto + s3fs
# (moto wants the newest boto3, no aiobotocore takes its botocore yet: ResolutionImpossible
# after ~2 minutes); pip 26 resolves the same set in ~80 s. .ci/run's unpinned mode does the
# same.
python -m pip install -q -U pip
echo "=== resolving .[all,test] at the newest versions in $venv"
python -m pip install -q -e ".[all,test]"
echo "=== the suite on them"
bash scripts/test.sh "$@"
{
  echo "# The versions the suite last passed with, on every backend (bash scripts/test.sh)."
  echo "# The README's commands install with '-c constraints.txt'. Refresh with"
  echo "# 'bash scripts/refresh_constraints.sh' (docs/development.md); written $(date -u +%Y-%m-%d),"
  echo "# Python $(python -c 'import platform; print(platform.python_version())') on $(uname -m) Linux."
  # `pip freeze --all` pins setuptools and wheel too (torch needs setuptools >= 77, newer
  # than a new venv's). A local version label (torch's "+cpu") is dropped: no package index
  # serves it, and "torch==2.13.0" takes the same CPU build where it lies on disk.
  python -m pip freeze --all --exclude-editable | grep -v -i -E '^(keras[-_]accel|pip)==' |
    sed -E 's/^([^=]+==[^+]+)\+.*$/\1/' | sort -f
} > constraints.txt
echo "=== wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins); review: git diff constraints.txt"
