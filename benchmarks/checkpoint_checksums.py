"""What BackupAndRestore's checksums cost: a save and a restore with and without them.

Each committed backup records every file's size and CRC32C (keras_accel/state/checksums.py)
in the engine's writer thread, and a restore checks them first (tf.train: reads every
tensor through TensorFlow's reader, which checks its own). This measures both sides on the
seed MLP (9.1M parameters; with Adam's two slots 104 MiB of training state) on a local
disk, each backend in its own process, the two configurations in turn in every round
(median of the rounds):

- a blocking save (`save_on_background=False`): `save()` until the step is committed;
- a background save: how long `save()` holds the training thread, and until committed;
- a restore: `restore()` of that step into the model (listing, checks, record, arrays);
- the record alone: `checksums.record` of the step's files (JAX and torch: tf.train writes
  none), and the check alone: the engine's `verify` of the step (tf.train: every tensor read
  through TensorFlow's checkpoint reader).

"Without" replaces `checksums.seal` and the engines' `verify` by no-ops for the run.
`--configs with,signed` compares CRC32C records with signed ones instead
(`BackupAndRestore(signing_key=...)`: each file's SHA-256 beside its CRC32C, and an
HMAC-SHA256 of them; the record alone is then timed with the SHA-256).

    python benchmarks/checkpoint_checksums.py --backends jax,tensorflow,torch
    python benchmarks/checkpoint_checksums.py --backends jax,tensorflow,torch --configs with,signed

Prints a Markdown table; `--json PATH` also writes the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("without", "with")  # Or ("with", "signed"): `--configs`.
KEY = b"keras_accel benchmark signing key"


@contextlib.contextmanager
def _unchecked(enabled: bool):
    """No checksum record written, none checked, for the `without` configuration."""
    if not enabled:
        yield
        return
    import keras

    from keras_accel.state import checksums
    from keras_accel.state.engines import engine_module

    module = engine_module(keras.backend.backend())
    seal, verify = checksums.seal, checksums.verify
    engine_verify = module.Engine.verify
    checksums.seal = lambda *args, **kwargs: None
    checksums.verify = lambda *args, **kwargs: False
    module.Engine.verify = lambda self, step: False
    try:
        yield
    finally:
        checksums.seal, checksums.verify = seal, verify
        module.Engine.verify = engine_verify


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    from keras_accel.callbacks import BackupAndRestore
    from keras_accel.models import compile_seed, mlp
    from keras_accel.state import checksums

    model = compile_seed(mlp(input_shape=(3072,)))
    model.optimizer.build(model.trainable_variables)
    state_bytes = sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for v in list(model.variables) + list(model.optimizer.variables)
    )
    configs = tuple(args.configs.split(","))
    times: dict[str, dict[str, list[float]]] = {
        config: {"save": [], "background_commit": [], "background_blocks": [], "restore": []}
        for config in configs
    }
    record_s: list[float] = []  # The record of a step's files, alone.
    verify_s: list[float] = []  # The check before a restore, alone.
    root = tempfile.mkdtemp(prefix="keras_accel-bench-")

    def backup(directory, background, config):
        callback = BackupAndRestore(
            directory,
            save_on_background=background,
            delete_checkpoint=False,
            max_to_keep=2,
            signing_key=KEY if config == "signed" else None,
        )
        callback.set_model(model)
        callback.set_params({"epochs": 2, "steps": 10, "verbose": 0})
        return callback

    try:
        for round_ in range(args.rounds):
            for config in configs if round_ % 2 == 0 else configs[::-1]:
                with _unchecked(config == "without"):
                    directory = os.path.join(root, f"{config}-{round_}")
                    blocking = backup(directory, background=False, config=config)
                    started = time.perf_counter()
                    path = blocking.save(1, 0)
                    times[config]["save"].append(time.perf_counter() - started)
                    blocking._backups.close()

                    background = backup(directory + "-bg", background=True, config=config)
                    started = time.perf_counter()
                    background.save(1, 0)
                    times[config]["background_blocks"].append(time.perf_counter() - started)
                    background.wait()
                    times[config]["background_commit"].append(time.perf_counter() - started)
                    background._backups.close()

                    restoring = backup(directory, background=False, config=config)
                    started = time.perf_counter()
                    assert restoring.restore()
                    times[config]["restore"].append(time.perf_counter() - started)
                    if config == configs[1]:
                        engine = restoring._backups.open()
                        step = engine.steps()[-1]
                        started = time.perf_counter()
                        engine.verify(step)
                        verify_s.append(time.perf_counter() - started)
                    restoring._backups.close()
                    if config == configs[1] and keras.backend.backend() != "tensorflow":
                        names = checksums.names_under(path, skip=("_CHECKPOINT_METADATA",))
                        started = time.perf_counter()
                        checksums.record(path, names, strong=config == "signed")
                        record_s.append(time.perf_counter() - started)
                shutil.rmtree(os.path.join(root, f"{config}-{round_}"), ignore_errors=True)
                shutil.rmtree(os.path.join(root, f"{config}-{round_}-bg"), ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    median = {
        config: {kind: statistics.median(values) for kind, values in kinds.items()}
        for config, kinds in times.items()
    }
    return {
        "backend": keras.backend.backend(),
        "parameters": model.count_params(),
        "state_bytes": state_bytes,
        "rounds": args.rounds,
        "configs": configs,
        "seconds": median,
        "record_s": statistics.median(record_s) if record_s else None,
        "verify_s": statistics.median(verify_s),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="without,with or with,signed")
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    script = os.path.join(HERE, "checkpoint_checksums.py")
    extra = [f"--rounds={args.rounds}", f"--configs={args.configs}"]
    rows = [run_child(script, b, extra) for b in args.backends.split(",")]
    first, second = args.configs.split(",")
    print(
        f"| backend | state MiB | blocking save, s: {first} / {second} | background save, until "
        f"committed | background save, training thread held | restore, s: {first} / {second} | "
        f"the record alone ({second}), s | the check alone ({second}), s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} |")
            continue
        s = row["seconds"]

        def pair(kind, s=s):
            without, with_ = s[first][kind], s[second][kind]
            return f"{without:.3f} / {with_:.3f} ({with_ / without - 1:+.0%})"

        record = "-" if row["record_s"] is None else f"{row['record_s']:.3f}"
        print(
            f"| {row['backend']} | {row['state_bytes'] / 2**20:.0f} | {pair('save')} | "
            f"{pair('background_commit')} | {pair('background_blocks')} | "
            f"{pair('restore')} | {record} | {row['verify_s']:.3f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
