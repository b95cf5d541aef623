"""One process of a torch model_parallel run over `keras-accel launch -n 2`. Usage:
python _torch_model_parallel.py OUT

37 rows in batches of 8 (the last padded), Dense -> BatchNormalization -> Dropout -> Dense,
Adam; a `keras.distribution.LayoutMap` splits the first kernel's columns and the second
kernel's rows over the "model" axis (the processes), and names a bias whose dimension the
process count does not divide (kept whole). Trained 2 epochs with validation, evaluated,
asked for every prediction: first under strategy="single" (each process alone, the
one-process reference), then under "model_parallel". A callback records, at each batch's
end, the local shape of every variable and optimizer slot this process holds. Then the
model_parallel fit stopped mid-epoch with BackupAndRestore and run again, resumed; the test's
one-process backup (WORKDIR/one.backup, written before the launch) resumed over the two;
a map with an entry that matches no variable; and a tiny keras-hub Gemma under the map its
class ships (`layout_map=keras_hub.models.GemmaCausalLM`), against each process alone. The
backup of the two is kept (WORKDIR/backup.kept) for the test to restore onto one process.
Every process writes what it saw to OUT-<process>.npz.
"""

import os
import shutil
import sys

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore
from keras_accel.utils import process


class HeldShapes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.shapes = {}

    def on_train_batch_end(self, batch, logs=None):
        from torch.distributed.tensor import DTensor

        for v in [*self.model.weights, *self.model.optimizer.variables]:
            value = v.value
            local = value.to_local() if isinstance(value, DTensor) else value
            self.shapes[v.path] = tuple(local.shape)


class StopAt(keras.callbacks.Callback):
    """Raises at the end of batch 2 of epoch 1 (step 8), after a backup of step 6."""

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == (1, 2):
            raise RuntimeError("stopped")


def run(strategy, layout_map=None, callbacks=()):
    """Fit, evaluate and predict under `strategy`: what this process saw."""
    acc = Accelerator(strategy=strategy, seed=0, layout_map=layout_map)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 6)).astype("float32")
    y = rng.normal(size=(37, 3)).astype("float32")
    keras.utils.set_random_seed(0)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="relu", name="first"),
                keras.layers.BatchNormalization(name="norm"),
                keras.layers.Dropout(0.3, seed=5),
                keras.layers.Dense(3, name="last"),
            ],
            name="net",
        )
        model.compile(
            optimizer=keras.optimizers.Adam(0.01, name="adam"), loss="mse", metrics=["mae"]
        )
    held = HeldShapes()
    history = acc.fit(
        model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[held, *callbacks],
        validation_data=(x[:13], y[:13]),
    )  # fmt: skip
    out = {f"history/{k}": np.asarray(v) for k, v in history.history.items()}
    for v in [*model.weights, *model.optimizer.variables]:
        out[f"var/{v.path}"] = np.asarray(v.numpy())
    out["evaluate"] = np.asarray(acc.evaluate(model, x, y, batch_size=8, verbose=0))
    out["predict"] = acc.predict(model, x, batch_size=8, verbose=0)
    for path, shape in held.shapes.items():
        out[f"held/{path}"] = np.asarray(shape)
    out["class"] = np.asarray(type(model.weights[0]).__name__)
    return acc, out


def stopped(strategy, layout_map, backup) -> None:
    """The fit stopped after step 8, its backups (every 3 steps) left in `backup`."""
    try:
        run(strategy, layout_map, [BackupAndRestore(backup, save_freq=3), StopAt()])
    except RuntimeError as error:
        assert str(error) == "stopped", error


def resumed(strategy, layout_map, backup) -> dict:
    """The fit run again, resumed from `backup`: what this process saw."""
    _, result = run(strategy, layout_map, [BackupAndRestore(backup, save_freq=3)])
    return {k: v for k, v in result.items() if not k.startswith("held/")}


def main(out_prefix: str) -> None:
    workdir = os.path.dirname(out_prefix)
    mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices=["cpu:0", "cpu:1"])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["net/first/kernel"] = (None, "model")  # (6, 8): columns over the processes.
    layout_map["net/last/kernel"] = ("model", None)  # (8, 3): rows over the processes.
    layout_map["net/last/bias"] = ("model",)  # (3,): 2 does not divide it: kept whole.
    _, one = run("single")  # Each process alone, as one process runs it.
    acc, ours = run("model_parallel", layout_map)
    out = {**{f"one/{k}": v for k, v in one.items()}, **{f"ours/{k}": v for k, v in ours.items()}}
    # Stopped mid-epoch with BackupAndRestore (each process writes its shards), resumed; and
    # the backup of one process (the test's, `one.backup`) resumed over the two.
    backup = os.path.join(workdir, "backup")
    stopped("model_parallel", layout_map, backup)
    if acc.is_chief:  # Kept for the test's restore onto one process (the resume deletes it).
        shutil.copytree(backup, f"{backup}.kept")
    process.barrier("kept")
    out.update(
        {f"resumed/{k}": v for k, v in resumed("model_parallel", layout_map, backup).items()}
    )
    one_backup = os.path.join(workdir, "one.backup")
    one_to_two = resumed("model_parallel", layout_map, one_backup)
    out.update({f"one_to_two/{k}": v for k, v in one_to_two.items()})
    # An entry that matches no variable (a typo, a renamed layer): refused before anything
    # is split.
    typo = keras.distribution.LayoutMap(mesh)
    typo["net/frist/kernel"] = (None, "model")
    try:
        run("model_parallel", typo)
        out["typo"] = np.asarray("trained")
    except ValueError as error:
        out["typo"] = np.asarray(str(error))
    out.update(hub())
    np.savez(f"{out_prefix}-{acc.process_index}.npz", **out)


def hub() -> dict:
    """A keras-hub Gemma (a tiny one, from its configuration) under the map its class ships
    (`layout_map=keras_hub.models.GemmaCausalLM`: `GemmaBackbone.get_layout_map`), and alone
    (strategy="single"): fit, evaluate, the variables and what this process holds."""
    try:
        import keras_hub
    except ImportError:  # Not installed: the test says so.
        return {}
    rows, length, vocabulary = 21, 6, 64
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, vocabulary, (rows, length)).astype("int32")
    x = {"token_ids": tokens, "padding_mask": np.ones((rows, length), "int32")}
    y = (tokens[:, 0] % 3).astype("int64")
    out = {}
    for name, strategy, layout_map in (
        ("one", "single", None),
        ("ours", "model_parallel", keras_hub.models.GemmaCausalLM),
    ):
        acc = Accelerator(strategy=strategy, seed=0, layout_map=layout_map)
        keras.utils.set_random_seed(0)
        with acc.scope():
            backbone = keras_hub.models.GemmaBackbone(
                vocabulary_size=vocabulary, num_layers=1, num_query_heads=4,
                num_key_value_heads=4, hidden_dim=16, intermediate_dim=32, head_dim=8,
            )  # fmt: skip
            inputs = {
                key: keras.Input((length,), dtype="int32", name=key)
                for key in ("token_ids", "padding_mask")
            }
            outputs = keras.layers.Dense(3, name="head")(backbone(inputs)[:, 0, :])
            model = keras.Model(inputs, outputs)
            model.compile(
                optimizer=keras.optimizers.Adam(0.01, name="adam"),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        held = HeldShapes()
        history = acc.fit(
            model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[held]
        )
        out[f"hub/{name}/history/loss"] = np.asarray(history.history["loss"])
        out[f"hub/{name}/evaluate"] = np.asarray(acc.evaluate(model, x, y, batch_size=8, verbose=0))
        for v in [*model.weights, *model.optimizer.variables]:
            out[f"hub/{name}/var/{v.path}"] = np.asarray(v.numpy())
        for path, shape in held.shapes.items():
            out[f"hub/{name}/held/{path}"] = np.asarray(shape)
    return out


if __name__ == "__main__":
    main(sys.argv[1])
