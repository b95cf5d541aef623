"""Grain inputs (`MapDataset`, `IterDataset`, `DataLoader`) train, evaluate and predict as
plain single-device Keras reads the same data: every epoch one full pass."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

grain = pytest.importorskip(
    "grain", reason="grain is not installed (pip install grain, or the 'grain' extra)"
)

from keras_accel import Accelerator  # noqa: E402
from tests.helpers import assert_weights_close, compiled_mlp, data  # noqa: E402

# Keras says "Your input ran out of data" after every pass of a Grain data set without a
# length, and that it ignores `shuffle`, under plain Keras too.
pytestmark = [
    pytest.mark.filterwarnings("ignore:Your input ran out of data"),
    pytest.mark.filterwarnings("ignore:`shuffle=True` was passed"),
]

ROWS, BATCH = 43, 16  # Three batches a pass, the last one partial (11 rows).


class Records:
    """A random-access data source, as `grain.DataLoader` reads one."""

    def __init__(self, *arrays):
        self.arrays = arrays

    def __len__(self):
        return len(self.arrays[0])

    def __getitem__(self, index):
        return tuple(a[index] for a in self.arrays)


def grain_data(kind, *arrays, batch=BATCH):
    """`arrays` (rows of x, y, ...) batched by Grain as `kind`."""
    records = Records(*arrays)
    if kind == "loader":
        return grain.DataLoader(
            data_source=records,
            sampler=grain.samplers.IndexSampler(len(records), shuffle=False, num_epochs=1),
            operations=[grain.transforms.Batch(batch)],
            worker_count=0,
        )
    dataset = grain.MapDataset.source(records).batch(batch)
    return dataset.to_iter_dataset() if kind == "iter" else dataset


class StepsPerEpoch(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.steps = []

    def on_epoch_begin(self, epoch, logs=None):
        self.steps.append(0)

    def on_train_batch_end(self, batch, logs=None):
        self.steps[-1] += 1


def _pair(acc):
    with acc.scope():
        model = compiled_mlp()
    twin = compiled_mlp()
    twin.set_weights(model.get_weights())
    return model, twin


# Every kind reaches Keras through the same data adapter; on TensorFlow (each step a graph
# over 8 replicas, minutes on a shared CPU) one kind, the one without a length, covers it.
KINDS = ["map", "iter", "loader"] if keras.backend.backend() == "jax" else ["iter"]


@pytest.mark.parametrize("kind", KINDS)
def test_grain_fits_every_epoch_a_full_pass_evaluates_and_predicts_as_keras(kind):
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(ROWS)
    ours, theirs = StepsPerEpoch(), StepsPerEpoch()
    history = acc.fit(model, grain_data(kind, x, y), epochs=3, verbose=0, callbacks=[ours]).history
    want = twin.fit(grain_data(kind, x, y), epochs=3, verbose=0, callbacks=[theirs]).history
    got_eval = acc.evaluate(model, grain_data(kind, x, y), verbose=0)
    want_eval = twin.evaluate(grain_data(kind, x, y), verbose=0)
    predictions = acc.predict(model, grain_data(kind, x), verbose=0)
    assert ours.steps == theirs.steps == [3, 3, 3]
    assert_weights_close(model.get_weights(), twin.get_weights())
    np.testing.assert_allclose(history["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got_eval, want_eval, rtol=1e-5)
    assert predictions.shape == (ROWS, 3)
    np.testing.assert_allclose(predictions, np.asarray(twin(x)), atol=1e-6)


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="a stream as validation_data (a generator too) takes minutes on TF's 8 replicas",
)
def test_grain_weights_and_validation_data_as_keras():
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(ROWS)
    w = np.linspace(0.5, 2.0, ROWS).astype("float32")
    vx, vy = data(21, seed=1)
    got = acc.fit(
        model,
        grain_data("map", x, y, w),
        validation_data=grain_data("iter", vx, vy, batch=8),
        epochs=2,
        verbose=0,
    ).history
    want = twin.fit(
        grain_data("map", x, y, w),
        validation_data=grain_data("iter", vx, vy, batch=8),
        epochs=2,
        verbose=0,
    ).history
    assert_weights_close(model.get_weights(), twin.get_weights())
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def test_repeated_grain_data_set_runs_for_steps_per_epoch_as_keras():
    """An endless MapDataset (`.repeat()`, whose length is sys.maxsize) is read on across
    epochs for `steps_per_epoch` steps each, as Keras reads it."""
    acc = Accelerator()
    model, twin = _pair(acc)
    x, y = data(ROWS)

    def endless():
        return grain.MapDataset.source(Records(x, y)).batch(BATCH).repeat()

    ours, theirs = StepsPerEpoch(), StepsPerEpoch()
    acc.fit(model, endless(), epochs=2, steps_per_epoch=2, verbose=0, callbacks=[ours])
    twin.fit(endless(), epochs=2, steps_per_epoch=2, verbose=0, callbacks=[theirs])
    assert ours.steps == theirs.steps == [2, 2]
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_keras_accel_never_imports_grain_itself():
    code = (
        "import sys, numpy as np\n"
        "import keras_accel, keras_accel.data.grain\n"
        "from keras_accel.data import sources\n"
        "assert sources.is_array_input(np.ones(3)) and not sources.is_grain_dataset([1])\n"
        "assert 'grain' not in sys.modules, 'grain was imported'\n"
        "print('OK')\n"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "OK" in result.stdout
