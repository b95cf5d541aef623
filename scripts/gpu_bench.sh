#!/usr/bin/env bash
# The seed's full benchmark sweep on a GPU machine that has JAX but neither Keras nor
# TensorFlow, and no network: CIFAR-10-shaped data (50,000 samples), batch sizes 256 to 50,000,
# the MLP and the CNN, float32 and bfloat16, KERAS_BACKEND=jax.
#
# Usage: bash scripts/gpu_bench.sh [--dry-run]
#
#   --dry-run   check the wheels and print every command without installing or running.
#
# Keras comes from wheels carried in the checkout (copy ../shared/gpu-wheels/*.whl, beside the
# repository root, into .whl/, which git ignores; see that folder's README). Without .whl/ the
# script looks in ../shared/gpu-wheels itself. Settings, from the environment:
#
#   OUT=$OUT or ./out/gpu_bench   where the Markdown, JSON, CSV and logs go
#   WHEELS=.whl                   folder of keras/namex/optree wheels (else ../shared/gpu-wheels)
#   SITE=/tmp/site                where they are installed (pip --target)
#   PYTHON=python3
#   MODELS="mlp cnn"  PRECISIONS="float32 bfloat16"
#   BATCH_SIZES=256,1024,4096,8192,16384,50000  SAMPLES=50000  EPOCHS=4
#   TIMEOUT=600                   seconds per configuration before it is killed
#   FLOPS_FROM=hlo                XLA cost analysis of the unoptimized step (no extra compile)
#   FIND_BATCH_SIZE=0             1: also find the largest CNN bfloat16 batch that fits
#   STEP_GROUPS=1                 0: skip the small-batch rows with and without on-device
#                                 step groups (benchmarks/fusion.py: plain model.fit, Keras's
#                                 steps_per_execution=32, acc.fit "auto")
#   STEP_GROUPS_SCALE=1  STEP_GROUPS_ROUNDS=3   their rows (a fraction of each case's) and
#                                 timed rounds
#
# Every configuration runs in its own process, so an out-of-memory error is an "OOM" row and
# the sweep goes on. Each (model, precision) writes its files as soon as it finishes: a run
# cut short keeps what it measured. To fit short device sessions, run it in parts, e.g.
# MODELS=cnn PRECISIONS=bfloat16 bash scripts/gpu_bench.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    -h | --help) sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_bench.sh: unknown argument '$arg'. Valid: --dry-run, --help." >&2; exit 2 ;;
  esac
done

PYTHON=${PYTHON:-python3}
OUT=${OUT:-$PWD/out/gpu_bench}
SHARED_WHEELS=../shared/gpu-wheels  # The shared folder, relative to the repository root.
if [ -z "${WHEELS:-}" ]; then
  WHEELS=.whl
  if ! compgen -G ".whl/*.whl" > /dev/null && [ -d "$SHARED_WHEELS" ]; then WHEELS=$SHARED_WHEELS; fi
fi
SITE=${SITE:-/tmp/site}
MODELS=${MODELS:-mlp cnn}
PRECISIONS=${PRECISIONS:-float32 bfloat16}
BATCH_SIZES=${BATCH_SIZES:-256,1024,4096,8192,16384,50000}
SAMPLES=${SAMPLES:-50000}
EPOCHS=${EPOCHS:-4}
TIMEOUT=${TIMEOUT:-600}
FLOPS_FROM=${FLOPS_FROM:-hlo}
FIND_BATCH_SIZE=${FIND_BATCH_SIZE:-0}
STEP_GROUPS=${STEP_GROUPS:-1}
STEP_GROUPS_SCALE=${STEP_GROUPS_SCALE:-1}
STEP_GROUPS_ROUNDS=${STEP_GROUPS_ROUNDS:-3}

say() { echo "gpu_bench: $*" >&2; }
run() {
  # Print the command; run it unless this is a dry run.
  echo "+ $*" >&2
  if [ "$DRY_RUN" -eq 0 ]; then "$@"; fi
}

# ---------------------------------------------------------------- 1. Keras from the wheels
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if [ "${#wheels[@]}" -eq 0 ]; then
  say "error: no wheels in '$WHEELS'. Copy ../shared/gpu-wheels/*.whl (beside the repository"
  say "root; a user's checkout has none) into .whl/ (keras, namex, optree; see that folder's"
  say "README), or set WHEELS=folder."
  exit 2
fi
to_install=()
for wheel in "${wheels[@]}"; do
  module=$(basename "$wheel" | cut -d- -f1)
  # A module the machine already has is left alone: its own build matches its Python, and
  # the carried optree wheel is for CPython 3.12 only.
  if [ "$module" != keras ] && "$PYTHON" -c "import $module" 2>/dev/null; then
    say "$module is already installed; skipping $(basename "$wheel")"
  else
    to_install+=("$wheel")
  fi
done
if [ "${#to_install[@]}" -gt 0 ]; then
  run "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${to_install[@]}"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" KERAS_BACKEND=jax
# Each configuration has the GPU to itself: let XLA use nearly all of its memory (default
# 75%), so "OOM" means the device is full, not that a default fraction is.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

# ---------------------------------------------------------------- 2. what is here
run mkdir -p "$OUT"
check='
import importlib.util, sys
import jax, keras, keras_accel
missing = [m for m in ("absl", "numpy", "rich", "h5py", "ml_dtypes", "packaging", "namex", "optree")
           if importlib.util.find_spec(m) is None]
print("python", sys.version.split()[0], "| keras", keras.__version__, "from", keras.__file__,
      "| jax", jax.__version__, "| backend", keras.backend.backend())
print("devices:", jax.devices())
assert "tensorflow" not in sys.modules, "TensorFlow was imported on the JAX path"
if missing:
    sys.exit(f"missing Keras dependencies: {missing} (pip show them; no network here)")
'
if [ "$DRY_RUN" -eq 0 ]; then
  "$PYTHON" -c "$check" | tee "$OUT/env.txt"
  if command -v nvidia-smi > /dev/null; then nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true; fi
else
  echo "+ $PYTHON -c <check: versions, devices, no TensorFlow imported> | tee $OUT/env.txt" >&2
fi
plot=()
if "$PYTHON" -c "import matplotlib" 2>/dev/null; then plot=(--plot); fi

# ---------------------------------------------------------------- 3. the sweep
status=0
for model in $MODELS; do
  for precision in $PRECISIONS; do
    name="${model}_${precision}"
    command=("$PYTHON" -m keras_accel.cli.main bench --model "$model"
      --mixed-precision "$precision" --batch-sizes "$BATCH_SIZES" --samples "$SAMPLES"
      --epochs "$EPOCHS" --backends jax --flops-from "$FLOPS_FROM" --timeout "$TIMEOUT"
      --synthetic --json "$OUT/$name.json" --csv "$OUT/$name.csv")
    if [ "${#plot[@]}" -gt 0 ]; then command+=(--plot "$OUT/$name.png"); fi
    say "$name -> $OUT/$name.md"
    echo "+ ${command[*]} > $OUT/$name.md 2> $OUT/$name.log" >&2
    if [ "$DRY_RUN" -eq 0 ]; then
      # One failed configuration must not stop the others; the exit status reports it.
      "${command[@]}" > "$OUT/$name.md" 2> "$OUT/$name.log" || status=1
      cat "$OUT/$name.md"
    fi
  done
done

if [ "$FIND_BATCH_SIZE" = 1 ]; then
  command=("$PYTHON" -m keras_accel.cli.main bench --find-batch-size --model cnn
    --mixed-precision bfloat16 --backends jax --start 1024 --max-batch-size 131072
    --multiple-of 1024 --json "$OUT/find_cnn_bfloat16.json")
  echo "+ ${command[*]} > $OUT/find_cnn_bfloat16.md" >&2
  if [ "$DRY_RUN" -eq 0 ]; then
    "${command[@]}" > "$OUT/find_cnn_bfloat16.md" 2> "$OUT/find_cnn_bfloat16.log" || status=1
    cat "$OUT/find_cnn_bfloat16.md"
  fi
fi
# ---------------------------------------------------------------- 4. small batches, grouped
# Where the seed found the device idle between steps: one host call per step against N steps
# in one compiled program (docs/accelerator.md, "Host-loop fusion").
if [ "$STEP_GROUPS" = 1 ]; then
  command=("$PYTHON" benchmarks/fusion.py --backends jax --cases dense@64,mlp@256
    --rounds "$STEP_GROUPS_ROUNDS" --scale "$STEP_GROUPS_SCALE" --json "$OUT/groups.json")
  echo "+ ${command[*]} > $OUT/groups.md 2> $OUT/groups.log" >&2
  if [ "$DRY_RUN" -eq 0 ]; then
    "${command[@]}" > "$OUT/groups.md" 2> "$OUT/groups.log" || status=1
    cat "$OUT/groups.md"
  fi
fi
say "done (status $status); files in $OUT"
exit "$status"
