#!/usr/bin/env bash
# Run the whole suite: ruff, then pytest under each Keras backend with 8 virtual CPU devices.
# Usage: bash scripts/test.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL=3 PYTHONDONTWRITEBYTECODE=1
python -m ruff check . || exit 1
status=0
for backend in ${KERAS_ACCEL_TEST_BACKENDS:-jax tensorflow}; do
  echo "=== KERAS_BACKEND=$backend, 8 virtual CPU devices"
  KERAS_BACKEND=$backend KERAS_ACCEL_TEST_DEVICES=8 python -m pytest -q -p no:cacheprovider "$@"
  rc=$?
  # pytest exits 5 when nothing was collected: that is a failure of the suite, not a pass.
  if [ "$rc" -ne 0 ]; then echo "!!! $backend suite failed (pytest exit $rc)"; status=1; fi
done
exit $status
