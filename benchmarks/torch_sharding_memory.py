"""Per-process memory of one model under `data_parallel`, `fsdp` and `model_parallel` on
torch, beside torch's own FSDP2 on the same network (issue 60).

The model's state dwarfs its activations: a stack of square Dense layers (`--width`,
`--depth`, no activation) trained with Adam (two slots per weight) on MSE at a small global
batch. Each strategy runs in its own `keras-accel launch -n N` (`--processes`, each count in
turn), and so does the peer: the same network written as a torch `nn.Sequential` of
`nn.Linear`, each layer then the root sharded with FSDP2's `fully_shard` on a one-axis
`DeviceMesh` of the processes (torch's recipe), trained with `torch.optim.Adam` on each
process's rows of the same global batch. `model_parallel` splits every kernel's columns
and every bias over the processes (a `LayoutMap`); every process runs the whole batch.

Each process reports, and the table shows the largest over the processes:

- state: the bytes of weights + optimizer variables this process holds between steps,
  summed over the tensors' local shards (`DTensor.to_local()`: what the layout put there,
  not our bookkeeping);
- held: the process's resident memory between steps above its base (its RSS after torch,
  Keras and the process group started and the data was made, before the model);
- peak: the highest resident memory during the timed steps above the same base (Linux's
  `VmHWM`, reset before each step through `/proc/self/clear_refs`). Resident memory, not a
  torch counter: on CPU torch allocates through the C library's `malloc` and keeps no
  statistics of its own (`torch.cuda.memory_stats` has no CPU twin), and the profiler's
  memory events cost more than the steps. So that freed tensors leave the resident set when
  they are freed, the processes run with `MALLOC_MMAP_THRESHOLD_=65536`: every buffer of
  64 KiB or more is its own `mmap`, returned at `free` (glibc's default threshold grows up
  to 32 MiB as large blocks are freed, after which freed tensors stay in its heap and
  resident);
- step time: the median of the timed steps (after `--warmup` steps), each from its start
  to its end (Keras's `on_train_batch_begin` to `on_train_batch_end`; the peer's
  `zero_grad` to `optimizer.step`), as a ratio to `data_parallel` over as many processes.

"one layer" is one Dense layer's weights whole (kernel and bias, float32); the table gives
how far the peak is above the state held, in layers: sharding's goal is the state at 1/N
and a peak within about one layer of it (the layer being gathered, and its gradient before
it is reduce-scattered).

    python benchmarks/torch_sharding_memory.py --processes 2,4

Prints a Markdown table; `--json PATH` also writes the figures. On a CPU host the
processes share the host's cores (`keras-accel launch` gives each one OpenMP thread), so
step times say what the strategies' extra work costs, not what N devices give.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ("data_parallel", "fsdp", "model_parallel", "fsdp2_peer")
# Every buffer of 64 KiB or more its own mmap, unmapped at free: resident memory follows the
# tensors alive (see the docstring). glibc reads it when a process starts.
MMAP_THRESHOLD = "65536"


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    """VmHWM from now on: the highest resident set from this point (Linux 4.0+)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Meter:
    """Per step: the resident memory before, its highest during, the time it took."""

    def __init__(self):
        self.base = _status("VmRSS")
        self.peaks, self.held, self.times = [], [], []
        self.started = 0.0

    def begin(self) -> None:
        self.held.append(_status("VmRSS"))
        _reset_peak()
        self.started = time.perf_counter()

    def end(self) -> None:
        self.times.append(time.perf_counter() - self.started)
        self.peaks.append(_status("VmHWM"))

    def figures(self, warmup: int, state_bytes: int, live_bytes: int) -> dict:
        return {
            "state_bytes": state_bytes,
            "live_bytes": live_bytes,
            "held_bytes": max(self.held[warmup:]) - self.base,
            "peak_bytes": max(self.peaks[warmup:]) - self.base,
            "step_s": statistics.median(self.times[warmup:]),
        }


def _live_tensor_bytes() -> int:
    """The bytes of every tensor storage alive in this process (found through Python's
    garbage collector, each storage once; a `DTensor` counts by its local tensor), cyclic
    garbage collected first (an eager step leaves some, freed at the collector's next run)."""
    import gc

    import torch
    from torch.distributed.tensor import DTensor

    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def _data(args, rank: int, processes: int, whole_batch: bool):
    """This process's rows of `--steps` global batches (all of them: `whole_batch`)."""
    import numpy as np

    rows = args.batch_size * args.steps
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.normal(size=(rows, args.width)).astype("float32")
    if whole_batch:
        return x, y, args.batch_size
    per = args.batch_size // processes
    # Each global batch's rows of this process, as the Accelerator feeds them (contiguous).
    take = np.concatenate(
        [np.arange(s * args.batch_size + rank * per, s * args.batch_size + (rank + 1) * per)
         for s in range(args.steps)]
    )  # fmt: skip
    return x[take], y[take], per


def keras_child(args) -> dict:
    import keras

    from keras_accel import Accelerator

    processes = int(os.environ.get("WORLD_SIZE", "1"))
    layout_map = None
    if args.strategy == "model_parallel":
        devices = [f"cpu:{i}" for i in range(processes)]
        mesh = keras.distribution.DeviceMesh((1, processes), ["batch", "model"], devices=devices)
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["net/dense_.*/kernel"] = (None, "model")
        layout_map["net/dense_.*/bias"] = ("model",)
    acc = Accelerator(strategy=args.strategy, seed=0, layout_map=layout_map)
    x, y, _ = _data(args, 0, processes, whole_batch=True)  # The Accelerator splits the rows.
    meter = Meter()
    with acc.scope():
        layers = [keras.Input((args.width,))]
        layers += [keras.layers.Dense(args.width, name=f"dense_{i}") for i in range(args.depth)]
        model = keras.Sequential(layers, name="net")
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    state, live = [], []

    class Measure(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            meter.begin()

        def on_train_batch_end(self, batch, logs=None):
            meter.end()
            variables = [*self.model.weights, *self.model.optimizer.variables]
            state.append(_local_bytes(v.value for v in variables))
            if batch == args.steps - 1:  # Inside the call: as held between steps.
                live.append(_live_tensor_bytes())

    acc.fit(model, x, y, batch_size=args.batch_size, epochs=1, shuffle=False, verbose=0,
            callbacks=[Measure()])  # fmt: skip
    return {"rank": acc.process_index, **meter.figures(args.warmup, state[-1], live[-1])}


def peer_child(args) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, processes = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (processes,))
    x, y, per = _data(args, rank, processes, whole_batch=False)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    meter = Meter()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width) for _ in range(args.depth)]
    )
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        rows = slice(step * per, (step + 1) * per)
        meter.begin()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])
        loss.backward()
        optimizer.step()
        meter.end()
    slots = [t for s in optimizer.state.values() for t in s.values() if t.dim()]
    state_bytes = _local_bytes([*model.parameters(), *slots])
    live = _live_tensor_bytes()
    return {"rank": rank, **meter.figures(args.warmup, state_bytes, live)}


def child(args) -> None:
    report = peer_child(args) if args.strategy == "fsdp2_peer" else keras_child(args)
    # The chief prints every process's figures (the launcher prefixes its lines).
    import torch.distributed as dist

    reports = [report]
    if dist.is_available() and dist.is_initialized():
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
    if report["rank"] == 0:
        print(json.dumps({"processes": reports}))
    if args.strategy == "fsdp2_peer":
        dist.destroy_process_group()  # The peer's group (the Keras runs' is the Accelerator's).


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4", help="process counts, comma-separated")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16, help="the global batch")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--json", default=None)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    counts = [int(n) for n in args.processes.split(",")]
    for n in counts:
        if args.batch_size % n or args.width % n:
            parser.error(f"--processes {n} must divide --batch-size and --width")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    for strategy in args.strategies.split(","):
        if strategy not in STRATEGIES:
            parser.error(f"--strategies: unknown {strategy!r}; choose from {', '.join(STRATEGIES)}")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # Inherited by every process.
    argv = [
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
    ]
    script = os.path.abspath(__file__)
    rows = []
    for n in counts:
        for strategy in args.strategies.split(","):
            result = run_child(script, "torch", [*argv, f"--strategy={strategy}"], processes=n)
            rows.append({"strategy": strategy, "processes_count": n, **result})
    layer = (args.width * args.width + args.width) * 4
    replicated = 3 * layer * args.depth  # Weights and Adam's two slots, whole.
    print(table(rows, args, layer, replicated))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layer_bytes": layer, "replicated_state_bytes": replicated,
                       "rows": summarize(rows, layer, replicated)}, f, indent=2)  # fmt: skip
    return 0


def summarize(rows: list[dict], layer: int, replicated: int) -> list[dict]:
    """Per row: the largest figure over its processes, and its ratios."""
    out = []
    for row in rows:
        if "error" in row:
            out.append(row)
            continue
        each = row["processes"]
        keys = ("state_bytes", "live_bytes", "held_bytes", "peak_bytes", "step_s")
        worst = {k: max(p[k] for p in each) for k in keys}
        out.append({"strategy": row["strategy"], "processes": row["processes_count"], **worst,
                    "state_share": worst["state_bytes"] / replicated,
                    "peak_over_held_layers": (worst["peak_bytes"] - worst["held_bytes"]) / layer,
                    "per_process": each})  # fmt: skip
    for row in out:
        same = [r for r in out if "error" not in r and r["processes"] == row.get("processes")]
        base = next((r for r in same if r["strategy"] == "data_parallel"), None)
        if "error" not in row:
            row["step_vs_data_parallel"] = base and row["step_s"] / base["step_s"]
    return out


def table(rows: list[dict], args, layer: int, replicated: int) -> str:
    mib = 2**20
    lines = [
        f"{args.depth} x Dense({args.width}), Adam, global batch {args.batch_size}, "
        f"one layer {layer / mib:.1f} MiB, replicated state {replicated / mib:.1f} MiB",
        "",
        "| processes | strategy | state / process (MiB) | share of replicated "
        "| tensors alive / process (MiB) | RSS held / process (MiB) "
        "| RSS peak / process (MiB) | peak - held (layers) | step (ms) "
        "| step time vs data_parallel |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summarize(rows, layer, replicated):
        if "error" in row:
            lines.append(f"| {row['processes_count']} | {row['strategy']} | {row['error']} |")
            continue
        ratio = row["step_vs_data_parallel"]
        lines.append(
            f"| {row['processes']} | {row['strategy']} | {row['state_bytes'] / mib:.1f} "
            f"| {row['state_share']:.3f} | {row['live_bytes'] / mib:.1f} "
            f"| {row['held_bytes'] / mib:.1f} | {row['peak_bytes'] / mib:.1f} "
            f"| {row['peak_over_held_layers']:.1f} | {row['step_s'] * 1e3:.0f} "
            f"| {f'{ratio:.2f}' if ratio else '-'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
