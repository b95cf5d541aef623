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
echo "=== resolving .[all,test] at the newest versions in $venv"
python -m pip install -q -e ".[all,test]"
echo "=== the suite on them"
bash scripts/test.sh "$@"
{
  echo "# The versions the suite last passed with, on both backends (bash scripts/test.sh)."
  echo "# The README's commands install with '-c constraints.txt'. Refresh with"
  echo "# 'bash scripts/refresh_constraints.sh' (docs/development.md); written $(date -u +%Y-%m-%d),"
  echo "# Python $(python -c 'import platform; print(platform.python_version())') on $(uname -m) Linux."
  python -m pip freeze --exclude-editable | grep -v -i '^keras[-_]accel'
} > constraints.txt
echo "=== wrote constraints.txt ($(grep -vc '^#' constraints.txt) pins); review: git diff constraints.txt"
