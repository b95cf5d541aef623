"""The Keras internals keras_accel relies on: all present in this Keras, and a missing one is
an error that names it and the Keras version, never a silent no-op."""

import keras
import pytest

from keras_accel.utils import keras_internals


def test_every_listed_internal_exists_in_the_installed_keras():
    keras_internals.check.cache_clear()
    keras_internals.check()


def test_a_missing_internal_names_itself_and_the_keras_version(monkeypatch):
    monkeypatch.setattr(
        keras_internals,
        "REQUIRED",
        [*keras_internals.REQUIRED, ("keras.layers:Dense", "_renamed_in_keras_9", "testing")],
    )
    keras_internals.check.cache_clear()
    try:
        with pytest.raises(keras_internals.KerasInternalsError) as caught:
            keras_internals.check()
    finally:
        keras_internals.check.cache_clear()
    message = str(caught.value)
    assert "`keras.layers:Dense._renamed_in_keras_9` (testing)" in message
    assert f"Keras {keras.__version__} does not have" in message
    assert "pip install -c constraints.txt" in message


def test_require_on_an_instance():
    layer = keras.layers.BatchNormalization()
    assert keras_internals.require(layer, "_moments", "why") == layer._moments
    with pytest.raises(keras_internals.KerasInternalsError, match="BatchNormalization._gone"):
        keras_internals.require(layer, "_gone", "why")
