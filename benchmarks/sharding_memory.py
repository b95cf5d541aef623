"""Per-device memory of one model under `data_parallel`, `fsdp` and `model_parallel` (JAX).

The model's state dwarfs its activations: a stack of square Dense layers (`--width`,
`--depth`) trained with Adam (two slots per weight) at a small batch. Each strategy runs in
its own child process on `--devices` virtual CPU devices, and reports, per device (the
largest over the devices):

- state: the bytes of weights + optimizer variables a device holds, summed over the
  arrays' own addressable shards (what the layout put there, not our bookkeeping);
- step: what one compiled training step holds on a device, from XLA's memory analysis of
  the model's `train_step` compiled again here (donated, as Keras compiles it; outside the
  Accelerator's call, so without its row-mask wrappers): arguments + outputs + temporaries,
  less what the outputs alias, XLA's bound on the step's live bytes;
- step time: the median of `--steps` timed steps after a warm-up, beside data_parallel's.

Each strategy is measured under each of XLA's two CPU schedulers (`--schedulers`):
"concurrency", XLA's CPU default, which orders a step for parallelism across the CPU's
threads and so may keep more buffers live at once (here: more gathered weights), and
"memory" (`--xla_cpu_enable_concurrency_optimized_scheduler=false`), which orders it to
keep fewer live. The strategies are compared under the same scheduler.

    python benchmarks/sharding_memory.py --devices 8

Prints a Markdown table; `--json PATH` also writes the figures.
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
STRATEGIES = ("data_parallel", "fsdp", "model_parallel")
# XLA's CPU schedulers, by the flag that picks them (the default first).
SCHEDULERS = {
    "concurrency": "",
    "memory": "--xla_cpu_enable_concurrency_optimized_scheduler=false",
}


def measure(args) -> dict:
    import keras_accel

    keras_accel.configure_virtual_cpu_devices(args.devices)
    flag = SCHEDULERS[args.scheduler]
    if flag:  # Read by XLA when JAX starts its CPU backend, below.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax
    import keras
    import numpy as np

    from keras_accel import Accelerator

    acc = Accelerator(strategy=args.strategy, seed=0)
    with acc.scope():
        layers = [keras.Input((args.width,))]
        layers += [keras.layers.Dense(args.width, name=f"dense_{i}") for i in range(args.depth)]
        model = keras.Sequential(layers)
        model.compile(optimizer="adam", loss="mse")
    rows = args.batch_size * (args.steps + 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.normal(size=(rows, args.width)).astype("float32")

    class Timer(keras.callbacks.Callback):
        ends: list = []

        def on_train_batch_end(self, batch, logs=None):
            jax.block_until_ready(logs)
            self.ends.append(time.perf_counter())

    timer = Timer()
    acc.fit(
        model, x, y, batch_size=args.batch_size, epochs=1, verbose=0, callbacks=[timer],
        shuffle=False,
    )  # fmt: skip
    step_s = statistics.median(b - a for a, b in zip(timer.ends[1:], timer.ends[2:]))

    variables = [*model.weights, *model.optimizer.variables]
    held: dict = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    whole = sum(int(np.prod(v.shape)) * v.value.dtype.itemsize for v in variables)

    # The step Keras compiled, lowered again on the state and a batch as it lays them out.
    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    layout = acc.distribution.get_data_layout((args.batch_size, args.width)).backend_layout
    batch = tuple(jax.device_put(a[: args.batch_size], layout) for a in (x, y))
    # Donated, as Keras compiles it: the new state takes the old one's buffers.
    compiled = jax.jit(model.train_step, donate_argnums=0).lower(state, batch).compile()
    analysis = compiled.memory_analysis()
    step_bytes = None
    if analysis is not None:
        step_bytes = (
            analysis.argument_size_in_bytes
            + analysis.output_size_in_bytes
            + analysis.temp_size_in_bytes
            - analysis.alias_size_in_bytes
        )
    return {
        "strategy": args.strategy,
        "scheduler": args.scheduler,
        "devices": args.devices,
        "replicated_state_bytes": whole,
        "state_bytes_per_device": max(held.values()),
        "step_bytes_per_device": step_bytes,
        "step_s": step_s,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--scheduler", default="concurrency", help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--strategy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    argv = [
        f"--devices={args.devices}",
        f"--width={args.width}",
        f"--depth={args.depth}",
        f"--batch-size={args.batch_size}",
        f"--steps={args.steps}",
    ]
    for scheduler in args.schedulers.split(","):
        if scheduler not in SCHEDULERS:
            known = ", ".join(SCHEDULERS)
            parser.error(f"--schedulers: unknown {scheduler!r}; choose from {known}")
    rows = []
    for scheduler in args.schedulers.split(","):
        for strategy in args.strategies.split(","):
            script = os.path.join(HERE, "sharding_memory.py")
            child = [*argv, f"--strategy={strategy}", f"--scheduler={scheduler}"]
            row = run_child(script, "jax", child)
            rows.append({"strategy": strategy, "scheduler": scheduler, **row})
    mib = 2**20
    print(f"{args.depth} x Dense({args.width}), Adam, batch {args.batch_size}, "
          f"{args.devices} devices")  # fmt: skip
    print("| XLA CPU scheduler | strategy | state / device (MiB) | share of replicated "
          "| step peak / device (MiB) | vs data_parallel "
          "| step time vs data_parallel |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['scheduler']} | {row['strategy']} | {row['error']} |")
            continue
        base = next(
            (
                r
                for r in rows
                if r["strategy"] == "data_parallel"
                and r["scheduler"] == row["scheduler"]
                and "error" not in r
            ),
            None,
        )
        share = row["state_bytes_per_device"] / row["replicated_state_bytes"]
        step = row["step_bytes_per_device"]
        base_step = base and base.get("step_bytes_per_device")
        vs = f"{step / base_step:.3f}" if step and base_step else "-"
        time_ratio = f"{row['step_s'] / base['step_s']:.2f}" if base else "-"
        step_text = f"{step / mib:.1f}" if step else "-"
        print(
            f"| {row['scheduler']} | {row['strategy']} | {row['state_bytes_per_device'] / mib:.1f} "
            f"| {share:.3f} | {step_text} | {vs} | {time_ratio} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
