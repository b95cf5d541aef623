"""The `keras.callbacks.CallbackList` of our Keras calls: Keras's own, without dispatching
the batch hooks that none of its callbacks implements.

Keras 3.15's CallbackList calls every batch hook once per host call of the step function,
whether or not a callback does anything there: on JAX it hands each batch end to a thread
pool, whose thread converts the logs to Python numbers (waiting for the device), and on
TensorFlow and torch it converts them on the main thread (a host sync per call). With
Keras's defaults (`History`, no progress bar at `verbose=0`) no callback has a batch hook,
and that work is all the hooks do: 5% of a small model's epoch on JAX and with XLA on
TensorFlow, 2% on torch (benchmarks/hand_loop.py, docs/benchmarks.md). tf.keras skipped
such hooks the same way (its `_should_call_train_batch_hooks`). A list with one callback
that implements a hook dispatches that hook as Keras does, to every callback.

Our list is made with the arguments Keras's trainers give their own (`add_history` in `fit`,
a progress bar where `verbose` is on, `epochs`, `steps` as Keras's epoch iterator counts
them), and Keras takes a `CallbackList` as it is: the public way in. Only for data whose
batch count we know as Keras's iterator would (our own data adapters); other data, or a
list the user made, go to Keras as they came.
"""

from __future__ import annotations

import keras

from keras_accel.adapter.fusion import batch_hooks
from keras_accel.adapter.protocol import run_context
from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.state import keras_writers

KINDS = ("train", "test", "predict")


class CallbackList(keras.callbacks.CallbackList):
    """Keras's CallbackList whose batch hooks return at once where no callback of the list
    implements them (decided when the list is made: Keras's calls add none later)."""

    def __init__(self, callbacks=None, add_history=False, add_progbar=False, model=None, **params):
        super().__init__(
            callbacks, add_history=add_history, add_progbar=add_progbar, model=model, **params
        )
        # A callback with any batch hook of a kind (a method of its class, or an attribute
        # such as `LambdaCallback`'s) has that kind's hooks dispatched, begins and ends.
        self._hooked = hooked(self.callbacks)
        announce(self.callbacks, self._hooked)

    def on_train_batch_begin(self, batch, logs=None):
        if self._hooked["train"]:
            super().on_train_batch_begin(batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        if self._hooked["train"]:
            super().on_train_batch_end(batch, logs)

    def on_test_batch_begin(self, batch, logs=None):
        if self._hooked["test"]:
            super().on_test_batch_begin(batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        if self._hooked["test"]:
            super().on_test_batch_end(batch, logs)

    def on_predict_batch_begin(self, batch, logs=None):
        if self._hooked["predict"]:
            super().on_predict_batch_begin(batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        if self._hooked["predict"]:
            super().on_predict_batch_end(batch, logs)


def hooked(callbacks) -> dict[str, bool]:
    """Which kinds' batch hooks `callbacks` implement (any of them)."""
    return {kind: any(batch_hooks(c, kind) for c in callbacks) for kind in KINDS}


def announce(callbacks, hooked: dict[str, bool]) -> None:
    """Tell the callbacks that ask (`set_batch_hooks`: a runtime's, which skips per-step
    work that nobody reads, on torch over processes) which kinds' batch hooks their list
    dispatches."""
    for callback in callbacks:
        if hasattr(callback, "set_batch_hooks"):
            callback.set_batch_hooks(hooked)


def for_call(model, callbacks, data, *, verbose, epochs: int = 1, steps=None, history=False):
    """`callbacks` as Keras's `fit` (`history=True`, its `epochs`), `evaluate` or `predict`
    would wrap them for `data` and `steps` (its `steps_per_epoch` or `steps`), as our
    `CallbackList`; `callbacks` as they are where `data` is not one of our adapters or they
    are a `CallbackList` already."""
    # Keras's own file writers (TensorBoard, CSVLogger, ModelCheckpoint): the chief's files.
    keras_writers.chief_writes(callbacks, run_context(model).call_on_exit)
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    if not isinstance(data, PaddedBatchesAdapter) or getattr(data, "counts_lazily", False):
        # Keras's own list, which adds a History (no batch hooks) and, where `verbose` is on
        # and none is given, a progress bar (hooks of every kind).
        given = list(callbacks or [])
        found = hooked(given)
        if verbose and not any(isinstance(c, keras.callbacks.ProgbarLogger) for c in given):
            found = dict.fromkeys(KINDS, True)
        announce(given, found)
        return callbacks
    return CallbackList(
        callbacks,
        add_history=history,
        add_progbar=verbose != 0,
        verbose=verbose,
        epochs=epochs,
        steps=_keras_steps(data, steps),
        model=model,
    )


def _keras_steps(data, steps):
    """The batches per epoch Keras's epoch iterator counts (`EpochIterator.num_batches`):
    `steps`, at most `keras.config.max_steps_per_epoch()`, else the adapter's."""
    limit = keras.config.max_steps_per_epoch()
    if limit and (not steps or limit < steps):
        steps = limit
    return steps or data.num_batches
