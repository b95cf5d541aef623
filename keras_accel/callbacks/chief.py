"""`chief_only(callback)`: a callback built on every process that acts on the chief alone.

Experiment trackers' Keras callbacks (W&B's `WandbMetricsLogger`, MLflow's
`MlflowCallback`, Comet's) have no notion of processes: under `keras-accel launch -n 2`
each process logs every epoch, into a run of its own. Lightning's loggers and Accelerate's
trackers log from the main process only; this is the same for any Keras callback, without
an `if` around the callback list in the script. docs/trackers.md has the recipe for each
tracker.
"""

from __future__ import annotations

import keras

from keras_accel.utils import process

# Keras's hooks, as `keras.callbacks.CallbackList` calls them.
HOOKS = (
    "on_batch_begin",
    "on_batch_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_begin",
    "on_train_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
)


class ChiefOnly(keras.callbacks.Callback):
    """`callback` on the chief process; on the others every hook does nothing
    (see `chief_only`).

    Attributes:
        callback: the wrapped callback.
    """

    def __init__(self, callback: keras.callbacks.Callback):
        if not isinstance(callback, keras.callbacks.Callback):
            raise TypeError(
                "chief_only wraps a keras.callbacks.Callback. Received: "
                f"callback={callback!r} of type {type(callback).__name__}."
            )
        super().__init__()
        self.callback = callback
        # Only the hooks the callback implements: Keras runs a fit's batches without
        # waiting for the callbacks where none implements the batch hooks (its
        # `CallbackList` checks each hook for Keras's default), and so does this wrapper.
        for name in HOOKS:
            if getattr(type(callback), name, None) is not getattr(keras.callbacks.Callback, name):
                setattr(self, name, self._forward(name))

    def _forward(self, name: str):
        def hook(*args, **kwargs):
            if process.is_chief():
                getattr(self.callback, name)(*args, **kwargs)

        hook.__name__ = name
        return hook

    def set_model(self, model):
        super().set_model(model)
        if process.is_chief():
            self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if process.is_chief():
            self.callback.set_params(params)

    def __repr__(self) -> str:
        return f"chief_only({self.callback!r})"


def chief_only(callback: keras.callbacks.Callback) -> ChiefOnly:
    """Wrap `callback`, built on every process, so that only the chief's copy acts.

    Every hook (and `set_model`, `set_params`) reaches `callback` on the chief process
    (`keras_accel.utils.process.is_chief()`: process 0) and does nothing on the others. In
    `Accelerator.fit` the logs a hook receives are the global ones (every process's batches
    reduced), so the chief's logger records the run once, as one process would. In one
    process it is the callback itself, hook for hook.

    For callbacks that log what they are given (experiment trackers, your own writers),
    not for those that read every process's state themselves: a hook that reads a
    variable split over the processes may be a collective every process must join
    (keras_accel's own callbacks and Keras's `TensorBoard`, `CSVLogger` and
    `ModelCheckpoint` coordinate the processes already; docs/callbacks.md).

    Args:
        callback: a `keras.callbacks.Callback`.

    Returns:
        A `keras.callbacks.Callback` to put in the fit's callbacks; the wrapped one is its
        `callback` attribute.

    Example:

    ```python
    import keras
    from keras_accel import Accelerator
    from keras_accel.callbacks import chief_only

    acc = Accelerator()
    logger = chief_only(keras.callbacks.CSVLogger("log.csv"))  # e.g. WandbMetricsLogger()
    # acc.fit(model, x, y, epochs=3, callbacks=[logger])  # log.csv: each epoch once
    ```
    """
    return ChiefOnly(callback)
