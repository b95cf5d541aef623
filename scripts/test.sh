#!/usr/bin/env bash
# Run the whole suite: ruff, then pytest under each Keras backend: JAX and TensorFlow with 8
# virtual CPU devices, torch with one (a torch process is one device; its multi-process tests
# start their own processes). The torch run collects only the tests marked `torch`
# (tests/conftest.py).
# Usage: bash scripts/test.sh [extra pytest args]
#
# The backends run side by side, one pytest process each: TensorFlow's run is mostly one
# thread tracing 8-replica programs, so JAX's fits beside it, and the suite takes about as
# long as the TensorFlow run alone. The other runs are niced: an 8-replica TF collective waits
# for all 8 of its threads, and each one descheduled by a busy neighbour stalls all of them
# (a 7 s test took 116 s beside JAX's multi-process tests un-niced), while JAX's run has time
# to spare, and so has torch's, the smallest (only the tests marked `torch`). Without extra
# pytest arguments (the whole suite) TensorFlow's run is two, side by side, tests/adapter and
# the rest: the suite's TF run alone used about one core of the two for its 40 minutes (user
# time 45 min in 41); and JAX's is two, tests/adapter with tests/distributed, and the rest
# (below). Each run's output goes to its own log,
# printed whole when that run ends (the first to finish first). KERAS_ACCEL_TEST_SEQUENTIAL=1
# runs them one after the other with their output as it comes; so does a single backend
# (KERAS_ACCEL_TEST_BACKENDS=jax; the default is "jax tensorflow torch").
set -uo pipefail
cd "$(dirname "$0")/.."
export TF_CPP_MIN_LOG_LEVEL=3 PYTHONDONTWRITEBYTECODE=1
python -m ruff check . || exit 1
# JAX's compilation cache, this run's own (removed at its end, so a run starts cold, as CI's
# does): the suite compiles the same programs over and over (the same small models, shapes
# and meshes in many tests, and in the processes its multi-process and resume tests start),
# and XLA compiles each once. The same compiled programs, so the same numbers; what a test
# traces is unchanged (the recompile guard counts traces). Measured on two of the adapter's
# files under JAX: 50.5 s of CPU without it, 42.4 s with it from cold.
jax_cache=$(mktemp -d "${TMPDIR:-/tmp}/keras-accel-jax-cache.XXXXXX")
trap 'rm -rf "$jax_cache"' EXIT
export JAX_COMPILATION_CACHE_DIR=$jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
read -r -a backends <<<"${KERAS_ACCEL_TEST_BACKENDS:-jax tensorflow torch}"
if [ "${#backends[@]}" -eq 0 ]; then echo "!!! KERAS_ACCEL_TEST_BACKENDS names no backend"; exit 1; fi

devices_of() {  # backend: the devices its run has.
  if [ "$1" = torch ]; then echo 1; else echo 8; fi
}

describe() {  # backend: its devices, in words.
  if [ "$1" = torch ]; then echo "1 device, the tests marked torch"; else echo "8 virtual CPU devices"; fi
}

run_backend() {  # backend [pytest args]: one pytest run.
  local backend=$1
  shift
  KERAS_BACKEND=$backend KERAS_ACCEL_TEST_DEVICES=$(devices_of "$backend") \
    nice -n "${NICENESS:-0}" python -m pytest -q -p no:cacheprovider "$@"
}

failed() {  # backend exit-status: pytest exits 5 when nothing was collected, a failure too.
  if [ "$2" -ne 0 ]; then echo "!!! $1 suite failed (pytest exit $2)"; return 0; fi
  return 1
}

status=0
if [ "${#backends[@]}" -eq 1 ] || [ "${KERAS_ACCEL_TEST_SEQUENTIAL:-0}" = 1 ]; then
  times=()
  for backend in "${backends[@]}"; do
    echo "=== KERAS_BACKEND=$backend, $(describe "$backend")"
    began=$SECONDS
    run_backend "$backend" "$@"
    rc=$?
    outcome=passed
    if failed "$backend" "$rc"; then status=1; outcome=failed; fi
    times+=("$backend $((SECONDS - began)) s ($outcome)")
  done
  echo "=== lanes, one after the other: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g')"
  exit $status
fi

logs=$(mktemp -d "${TMPDIR:-/tmp}/keras-accel-tests.XXXXXX")
declare -A backend_of=()
pids=()
stop() {  # Interrupted: stop every run still going (its pytest and what that started).
  trap - INT TERM
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
  # A SIGTERM inside a fit with BackupAndRestore is a preemption, which pytest reports as
  # that test's failure and goes on: what still runs after 10 s is killed.
  for _ in $(seq 20); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 -- "-$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.5
  done
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
  wait
  rm -rf "$logs"
  exit 130
}
trap stop INT TERM
started=$SECONDS
set -m  # Each run in its own process group, so that stop() reaches its children too.
lanes=()
start_lane() {  # name niceness backend [pytest args]: one pytest run in the background.
  local name=$1 niceness=$2
  shift 2
  NICENESS=$niceness run_backend "$@" >"$logs/$name.log" 2>&1 &
  backend_of[$!]=$name
  pids+=("$!")
  lanes+=("$name")
}
for backend in "${backends[@]}"; do
  niceness=10
  if [ "$backend" = tensorflow ]; then niceness=0; fi
  if [ "$#" -gt 0 ] || [ "$backend" = torch ]; then
    start_lane "$backend" "$niceness" "$backend" "$@"
  elif [ "$backend" = tensorflow ]; then
    # The whole TF suite in two runs: one thread each, most of the time, so two fit.
    start_lane tensorflow-adapter 0 tensorflow tests/adapter
    start_lane tensorflow-rest 0 tensorflow --ignore=tests/adapter
  else
    # JAX's in two as well: niced, it runs mostly after TensorFlow's, and alone one run
    # kept 0.9 of the 2 cores busy for the suite's last 14 minutes. Split where the CPU
    # splits about evenly (the adapter and the multi-process tests, the rest).
    start_lane "$backend-adapter" 10 "$backend" tests/adapter tests/distributed
    start_lane "$backend-rest" 10 "$backend" --ignore=tests/adapter --ignore=tests/distributed
  fi
done
set +m
echo "=== ${lanes[*]} side by side (logs in $logs)"
running=("${pids[@]}")
times=()
while [ "${#running[@]}" -gt 0 ]; do
  pid=
  wait -n -p pid "${running[@]}"
  rc=$?
  if [ -z "$pid" ]; then echo "!!! lost track of the pytest runs (wait exit $rc)"; stop; fi
  backend=${backend_of[$pid]}
  remaining=()
  for other in "${running[@]}"; do [ "$other" = "$pid" ] || remaining+=("$other"); done
  running=("${remaining[@]}")
  echo "=== KERAS_BACKEND=${backend%%-*} (${backend}), $(describe "${backend%%-*}"): ended after $((SECONDS - started)) s"
  cat "$logs/$backend.log"
  outcome=passed
  if failed "$backend" "$rc"; then status=1; outcome=failed; fi
  times+=("$backend $((SECONDS - started)) s ($outcome)")
done
rm -rf "$logs"
# Each lane's wall time, last, where CI's output ends: what the suite's time budget reads.
elapsed=$((SECONDS - started))
echo "=== lanes, side by side: $(IFS=,; echo "${times[*]}" | sed 's/,/, /g'); the suite: $((elapsed / 60)) min $((elapsed % 60)) s"
exit $status
