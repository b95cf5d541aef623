"""Keras's callbacks: the hooks keras_accel's ModelCheckpoint extends Keras's through, the
monitor rule of `keras.callbacks.ModelCheckpoint`, a callback's `_model`, and the
`keras.callbacks.CallbackList` calling a hook."""

from __future__ import annotations

import inspect

import keras

from keras_accel.utils.keras_internals.lookup import Internal, holder, public, require

_CHECKPOINT = public("keras.callbacks.ModelCheckpoint")
_WHY = {
    "_save_model": "ModelCheckpoint's chief-only save",
    "_get_file_path": "ModelCheckpoint's file names",
    "_should_save_model": "ModelCheckpoint's best value",
    "_set_monitor_op": "ModelCheckpoint's best value in a backup",
    "_is_improvement": "ModelCheckpoint's best value in a backup",
}
_CHECKPOINT_HOOKS = {
    name: Internal("keras.callbacks.ModelCheckpoint", name, why, _CHECKPOINT)
    for name, why in _WHY.items()
}

# Checked by `keras_internals.check()`. keras_accel.callbacks: ModelCheckpoint extends
# Keras's through these hooks, and every callback reads its model as `self._model` (Keras's
# `model` property syncs JAX state).
REQUIRED = [
    *_CHECKPOINT_HOOKS.values(),
    Internal(
        "keras.callbacks.Callback()",
        "_model",
        "a callback's model",
        lambda: keras.callbacks.Callback(),
    ),
]


def monitor_improves(callback, current, reference) -> bool:
    """Whether `current` improves on `reference` by a Keras monitor callback's own rule
    (`_is_improvement`: its mode, its `min_delta`), its direction set first as Keras sets
    it at the first epoch's end (`_set_monitor_op`)."""
    if callback.monitor_op is None:
        holder(_CHECKPOINT_HOOKS["_set_monitor_op"])._set_monitor_op(callback)
    improvement = holder(_CHECKPOINT_HOOKS["_is_improvement"])._is_improvement
    return bool(improvement(callback, current, reference))


def callback_model(callback):
    """The model a callback was given (`_model`), without Keras's `model` property, which
    on JAX first syncs the trainer's state into the model's variables."""
    return require(callback, "_model", "a callback's model")


def calling_callback_list(callback):
    """The `keras.callbacks.CallbackList` whose hook is calling `callback`'s, or None where
    none is (hooks called directly).

    Keras hands a callback the model and `params`, never its siblings, and `fit` keeps its
    CallbackList to itself; the list dispatches each hook from one of its own methods, so
    the list is the `self` of a frame just above this hook (one more where a subclass wraps
    the dispatch, as `Accelerator.loop`'s does). Checked against Keras 3.15's CallbackList,
    which calls each callback's hook from its own method of the same name.
    """
    frame = inspect.currentframe().f_back
    for _ in range(8):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList) and any(
            each is callback for each in owner.callbacks
        ):
            return owner
        frame = frame.f_back
    return None
