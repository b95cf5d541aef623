"""`keras_accel.callbacks.chief_only`: the wrapped callback's hooks on the chief, nothing on
the other processes, and Keras's fast path kept where the callback has no batch hooks.
Over 2 real processes: tests/distributed/test_keras_writers.py."""

import keras
import pytest

from keras_accel.callbacks import chief_only
from keras_accel.utils import process
from tests.helpers import compiled_mlp, data

pytestmark = pytest.mark.torch


class Recorder(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def set_model(self, model):
        super().set_model(model)
        self.calls.append("set_model")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(("epoch", epoch, sorted(logs)))

    def on_batch_end(self, batch, logs=None):
        self.calls.append(("batch", batch))


class EpochsOnly(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        pass


def _fit(callback):
    x, y = data(32)
    compiled_mlp().fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])


def test_on_the_chief_every_hook_reaches_the_callback_as_without_the_wrapper():
    bare, wrapped = Recorder(), Recorder()
    _fit(bare)
    keras.backend.clear_session()
    wrapper = chief_only(wrapped)
    _fit(wrapper)
    assert wrapped.calls == bare.calls
    assert ("batch", 1) in wrapped.calls and (
        "epoch",
        1,
        sorted(bare.calls[-1][2]),
    ) in wrapped.calls
    assert wrapper.callback is wrapped and repr(wrapper).startswith("chief_only(")


def test_on_the_other_processes_no_hook_reaches_the_callback(monkeypatch):
    monkeypatch.setattr(process, "is_chief", lambda: False)
    wrapped = Recorder()
    _fit(chief_only(wrapped))
    assert wrapped.calls == []


def test_only_the_hooks_the_callback_implements_are_hooks_of_the_wrapper():
    """Keras skips waiting for each batch where no callback implements the batch hooks
    (`CallbackList` checks them for its default): the wrapper keeps that."""
    wrapper = chief_only(EpochsOnly())
    assert "on_epoch_end" in vars(wrapper) and "on_train_batch_end" not in vars(wrapper)
    assert type(wrapper).on_train_batch_end is keras.callbacks.Callback.on_train_batch_end
    assert "on_batch_end" in vars(chief_only(Recorder()))


def test_anything_but_a_callback_is_refused():
    with pytest.raises(TypeError, match=r"chief_only wraps a keras.callbacks.Callback\. "):
        chief_only(lambda epoch: None)
