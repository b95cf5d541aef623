"""keras_accel's callbacks check the Keras internals they rely on under a plain `model.fit`
too (no Accelerator): a Keras without one fails with `KerasInternalsError`, naming the
internal and the Keras version, before the first step; never a silent no-op."""

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler, ModelCheckpoint
from keras_accel.utils import keras_internals
from tests.helpers import compiled_mlp, data

pytestmark = pytest.mark.torch  # A plain model.fit with keras_accel's callbacks, on every backend.

CALLBACKS = {
    "LearningRateScheduler": lambda tmp: LearningRateScheduler(lambda epoch: 0.01),
    "History": lambda tmp: History(path=str(tmp / "history.json")),
    "BackupAndRestore": lambda tmp: BackupAndRestore(str(tmp / "backup")),
    "ModelCheckpoint": lambda tmp: ModelCheckpoint(
        str(tmp / "model.weights.h5"), save_weights_only=True
    ),
}


@pytest.fixture(autouse=True)
def _fresh_checks(monkeypatch):
    """Each test sees unchecked internals, and leaves them so (what it patches is undone)."""
    keras_internals.check.cache_clear()
    monkeypatch.setattr(keras_internals, "_CHECKED_CLASSES", set())
    yield
    keras_internals.check.cache_clear()


def _assert_names_the_version(error, name: str) -> None:
    message = str(error.value)
    assert f"`{name}`" in message
    assert f"Keras {keras.__version__} does not have" in message
    assert f"tested with Keras {keras_internals.TESTED_KERAS}" in message


@pytest.mark.parametrize("name", CALLBACKS)
def test_a_missing_class_internal_fails_when_the_callback_is_made(name, monkeypatch, tmp_path):
    missing = keras_internals.Internal(
        "keras.Model", "_renamed_in_keras_9", "testing", lambda: keras.Model
    )
    monkeypatch.setattr(keras_internals, "REQUIRED", [*keras_internals.REQUIRED, missing])
    with pytest.raises(keras_internals.KerasInternalsError) as caught:
        CALLBACKS[name](tmp_path)
    _assert_names_the_version(caught, "_renamed_in_keras_9")


@pytest.mark.parametrize("holder", ["MODEL_ATTRIBUTES", "OPTIMIZER_ATTRIBUTES"])
@pytest.mark.parametrize("name", CALLBACKS)
def test_a_missing_instance_internal_fails_a_plain_fit_before_its_first_step(
    name, holder, monkeypatch, tmp_path
):
    callback = CALLBACKS[name](tmp_path)
    attributes = {**getattr(keras_internals, holder), "_renamed_in_keras_9": "testing"}
    monkeypatch.setattr(keras_internals, holder, attributes)
    model = compiled_mlp()
    x, y = data(32)
    with pytest.raises(keras_internals.KerasInternalsError) as caught:
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[callback])
    _assert_names_the_version(caught, "_renamed_in_keras_9")
    assert int(np.asarray(keras.ops.convert_to_numpy(model.optimizer.iterations))) == 0


def test_the_instance_check_runs_once_per_class(monkeypatch, tmp_path):
    model = compiled_mlp()
    read = []
    original = keras_internals.require

    def counting(obj, name, why):
        read.append(name)
        return original(obj, name, why)

    monkeypatch.setattr(keras_internals, "require", counting)
    keras_internals.check_model(model)
    first = len(read)
    keras_internals.check_model(model)
    keras_internals.check_model(compiled_mlp())
    # Only the optimizer's iteration count is read again (the variable to check the layout
    # on); every class was checked once.
    assert first > 0 and len(read) - first == 2
