"""Peak memory of `fit`, `evaluate` and `predict` on an `np.memmap` against its size, plain
Keras beside `acc`, on each backend; and the speed of a memmap beside the same array in
memory.

The data are a read-only `np.memmap` of `rows x 1024` float32 (4 KiB a row) and its targets,
`rows x 1` float32, both files in `--dir` (a fresh temporary folder by default, removed
afterwards), for each `--sizes` in GB (10**9 bytes: 0.5 GB is 125,003 rows, uneven); the
model is one `Dense(1)` (mse, SGD; `--hidden N` puts a `Dense(N, relu)` before it, some
work per row), one epoch at `--batch-size` 4096, `shuffle=True` in
`fit` (Keras's default). Each measurement is one child process: one call by one contestant
on one file, the model compiled and built on a small in-memory batch first. What is
reported is the process's peak *anonymous* resident memory during the call (`RssAnon` of
/proc/self/status, sampled every millisecond by a thread), in MiB: a memory map's pages are
the file's, reclaimable, and not counted, so the figure is what the call itself allocated on
top of the framework (the baseline, printed beside it: the process before the call).

`--contestants`: `plain` (the model's own `fit`/`evaluate`/`predict`), `acc`
(`Accelerator(seed=0)`: host-loop fusion "auto", up to 32 steps per call), and `acc@N`
(`Accelerator(seed=0, steps_per_execution=N)`): a fused call holds its N batches at once on
every backend, so the auto setting's groups of 32 batches of 16 MiB are 512 MiB whatever
the data's size.

    python benchmarks/arrays_on_disk.py                     # 0.5, 1, 2, 4 GB; about 20 min
    python benchmarks/arrays_on_disk.py --sizes 0.5 2 --contestants acc@4
    python benchmarks/arrays_on_disk.py --speed             # memmap / in memory, 0.5 GB

`--speed` times `acc.fit`, `evaluate` and `predict` (a warm-up, then `--rounds` rounds) on
the memmap and on the same arrays loaded into memory, alternately in one child process per
backend (the file's pages cached after the first read), with `Accelerator(jit_compile=False)`
so that the data path alone differs (the measured choice's trial of the compiled way would
land in one contestant's calls): the ratio is the memmap's time over the in-memory one's, the
median of the rounds (the first `--sizes`, loaded whole: it must
fit in memory). The files need free disk: one size's at a time (4.1 GB at 4 GB), all of them
where `--dir` keeps them (`df -h`). Prints Markdown tables; `--json PATH` also writes the
figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
BACKENDS = ("jax", "tensorflow", "torch")
CALLS = ("fit", "evaluate", "predict")
FEATURES = 1024


def rows_of(size_gb: float) -> int:
    """Rows of a file of `size_gb` GB, three past a round number (a last partial batch)."""
    return int(size_gb * 10**9 / (4 * FEATURES) // 1000 * 1000) + 3


def make_files(folder: str, rows: int) -> tuple[str, str]:
    """`x` (rows x 1024 float32) and `y` (rows x 1) as files in `folder`, written in blocks
    (never the whole array in memory); reused where they exist."""
    import numpy as np

    paths = (os.path.join(folder, f"x_{rows}.f32"), os.path.join(folder, f"y_{rows}.f32"))
    if all(os.path.exists(p) for p in paths):
        return paths
    x = np.memmap(paths[0], "float32", "w+", shape=(rows, FEATURES))
    y = np.memmap(paths[1], "float32", "w+", shape=(rows, 1))
    block = 65536
    for start in range(0, rows, block):
        rng = np.random.default_rng(start)
        part = rng.random((min(block, rows - start), FEATURES), dtype="float32")
        x[start : start + len(part)] = part
        y[start : start + len(part), 0] = part[:, :8].sum(axis=1)
    x.flush()
    y.flush()
    del x, y
    return paths


def rss_anon() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status (Linux only)")


class PeakSampler:
    """The peak of `rss_anon()` from `start()` to `stop()`, sampled every millisecond by a
    thread (reading /proc takes microseconds and releases nothing the call needs)."""

    def __init__(self):
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._done.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(0.001)

    def start(self):
        self.peak = rss_anon()
        self._thread.start()

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self.peak, rss_anon())


def _model_and_contestant(args):
    import keras
    import numpy as np

    from keras_accel import Accelerator

    def build():
        hidden = [keras.layers.Dense(args.hidden, activation="relu")] if args.hidden else []
        model = keras.Sequential([keras.Input((FEATURES,)), *hidden, keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(1e-3), "mse")
        return model

    if args.who == "plain":  # Keras alone: no Accelerator made.
        acc, model = None, build()
    else:
        spe = int(args.who.split("@")[1]) if "@" in args.who else "auto"
        # --speed: the step's way fixed, so that only the data path differs (the measured
        # choice's trial would land in whichever contestant's calls it reached).
        way = {"jit_compile": False} if args.speed else {}
        acc = Accelerator(seed=0, steps_per_execution=spe, **way)
        with acc.scope():
            model = build()
    model.predict(np.zeros((8, FEATURES), "float32"), verbose=0)  # Built, on a tiny batch.
    return acc, model


def _call(acc, model, who: str, call: str, x, y, batch_size: int):
    options = {"batch_size": batch_size, "verbose": 0}
    if who == "plain":
        if call == "fit":
            return model.fit(x, y, epochs=1, **options)
        if call == "evaluate":
            return model.evaluate(x, y, **options)
        return model.predict(x, **options)
    if call == "fit":
        return acc.fit(model, x, y, epochs=1, **options)
    if call == "evaluate":
        return acc.evaluate(model, x, y, **options)
    return acc.predict(model, x, **options)


def measure_memory(args) -> dict:
    import numpy as np

    x = np.memmap(args.x, "float32", "r", shape=(args.rows, FEATURES))
    y = np.memmap(args.y, "float32", "r", shape=(args.rows, 1))
    acc, model = _model_and_contestant(args)
    sampler = PeakSampler()
    sampler.start()
    base = sampler.peak
    started = time.perf_counter()
    _call(acc, model, args.who, args.call, x, y, args.batch_size)
    seconds = time.perf_counter() - started
    peak = sampler.stop()
    return {"base": base, "peak": peak, "seconds": seconds}


def measure_speed(args) -> dict:
    import numpy as np

    mapped = (
        np.memmap(args.x, "float32", "r", shape=(args.rows, FEATURES)),
        np.memmap(args.y, "float32", "r", shape=(args.rows, 1)),
    )
    memory = tuple(np.array(a) for a in mapped)  # The same arrays, loaded.
    args.who = "acc"  # The Accelerator, its step's way fixed (`_model_and_contestant`).
    acc, model = _model_and_contestant(args)
    ratios: dict = {call: [] for call in CALLS}
    for round_ in range(args.rounds + 1):  # The first round warms both up (compiles).
        for call in CALLS:
            times = {}
            for name, (x, y) in (("memmap", mapped), ("memory", memory)):
                started = time.perf_counter()
                _call(acc, model, "acc", call, x, y, args.batch_size)
                times[name] = time.perf_counter() - started
            if round_:
                ratios[call].append(times["memmap"] / times["memory"])
    return {call: statistics.median(values) for call, values in ratios.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--sizes", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--calls", nargs="+", default=list(CALLS), choices=CALLS)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--contestants", nargs="+", default=["plain", "acc"])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--hidden", type=int, default=0, help="a Dense(N, relu) before the Dense(1): work per row"
    )
    parser.add_argument("--dir", default=None, help="where the files go (kept if given)")
    parser.add_argument("--json", default=None)
    for hidden in ("--who", "--call", "--x", "--y"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure_speed(args) if args.speed else measure_memory(args)))
        return 0

    folder = args.dir or tempfile.mkdtemp(prefix="arrays_on_disk_")
    os.makedirs(folder, exist_ok=True)
    script = os.path.abspath(__file__)
    results: list = []
    try:
        if args.speed:
            rows = rows_of(args.sizes[0])  # The first size (0.5 GB by default).
            x, y = make_files(folder, rows)
            print(f"acc on a memmap / the same arrays in memory, {rows:,} rows x {FEATURES}:")
            print("\n| backend | " + " | ".join(CALLS) + " |\n|---|" + "---|" * len(CALLS))
            for backend in args.backends:
                argv = [f"--x={x}", f"--y={y}", f"--rows={rows}", "--speed"]
                argv += [f"--batch-size={args.batch_size}", f"--rounds={args.rounds}"]
                argv += [f"--hidden={args.hidden}"]
                got = run_child(script, backend, argv)
                results.append({"backend": backend, "rows": rows, **got})
                cells = [got.get("error") or f"{got[c]:.2f}" for c in CALLS]
                print(f"| {backend} | " + " | ".join(cells) + " |", flush=True)
            return _write(args, results)
        who = args.contestants
        for name in who:
            if name not in ("plain", "acc") and not name.startswith("acc@"):
                parser.error(f"--contestants: plain, acc or acc@N. Received: {name!r}")
        print(f"peak anonymous memory, MiB (baseline before the call), batch {args.batch_size}")
        print("\n| backend | call | size | rows | " + " | ".join(who) + " |")
        print("|---|---|---|---|" + "---|" * len(who))
        for size in args.sizes:
            rows = rows_of(size)
            x, y = make_files(folder, rows)
            for backend in args.backends:
                for call in args.calls:
                    cells = []
                    for contestant in who:
                        argv = [f"--x={x}", f"--y={y}", f"--rows={rows}", f"--call={call}"]
                        argv += [f"--who={contestant}", f"--batch-size={args.batch_size}"]
                        argv += [f"--hidden={args.hidden}"]
                        got = run_child(script, backend, argv)
                        results.append(
                            {"backend": backend, "call": call, "size_gb": size, "rows": rows,
                             "who": contestant, **got}
                        )  # fmt: skip
                        if "error" in got:
                            cells.append(got["error"])
                        else:
                            mib = lambda b: b / 2**20  # noqa: E731
                            cells.append(f"{mib(got['peak']):,.0f} ({mib(got['base']):,.0f})")
                    row = [backend, call, f"{size:g} GB", f"{rows:,}", *cells]
                    print("| " + " | ".join(row) + " |", flush=True)
            if args.dir is None:  # The next size's files: one size on disk at a time.
                for path in (x, y):
                    os.remove(path)
        return _write(args, results)
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)


def _write(args, results) -> int:
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=1)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
