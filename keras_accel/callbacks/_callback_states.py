"""The states of a fit's other callbacks in a backup: those with `state_dict()` and
`load_state_dict(state)` (`keras_accel.adapter.protocol`), gathered for every backup and given
back on resume, keyed by their `state_key` (else their class name)."""

from __future__ import annotations

import json

from keras_accel.adapter.protocol import run_context
from keras_accel.callbacks.history import History


def stateful(owner, model, fit_callbacks: list | None) -> dict:
    """{state key: callback} for the callbacks of the fit with `state_dict` and
    `load_state_dict`, `owner` aside; `fit_callbacks` the fit's others (weak references),
    None outside a fit's callback list: then Keras's handle, `model.history`."""
    if fit_callbacks is None:
        candidates = [getattr(model, "history", None)]
    else:
        candidates = [ref() for ref in fit_callbacks]
    found: dict = {}
    for callback in candidates:
        if callback is owner or not (
            callable(getattr(callback, "state_dict", None))
            and callable(getattr(callback, "load_state_dict", None))
        ):
            continue
        key = str(getattr(callback, "state_key", None) or type(callback).__name__)
        if key in found and found[key] is not callback:
            raise RuntimeError(
                f"BackupAndRestore: two callbacks of this fit save their state under the "
                f"same key {key!r} ({found[key]!r} and {callback!r}), so a resume could "
                "not tell them apart. Give each a distinct `state_key` attribute."
            )
        found[key] = callback
    return found


def gather(callbacks: dict, model, finished_epoch: int | None, logs: dict | None) -> dict:
    """Every `state_dict()` of `callbacks` (`stateful`), checked to be JSON-able (the record
    the engine commits is JSON). At an epoch's end, the run context says which epoch ended,
    for callbacks whose own `on_epoch_end` has not run yet."""
    context = run_context(model)
    context.epoch_end = None if finished_epoch is None else (int(finished_epoch), logs or {})
    try:
        states = {key: callback.state_dict() for key, callback in callbacks.items()}
    finally:
        context.epoch_end = None
    for key, state in states.items():
        try:
            json.dumps(state)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"BackupAndRestore: the state_dict() of the callback {key!r} cannot be "
                f"saved: it must be JSON-able (dicts, lists, strings, numbers, bool, "
                f"None). {type(e).__name__}: {e}"
            ) from e
    return states


def load(meta: dict, callbacks: dict) -> None:
    """Give each of `callbacks` (`stateful`) its state from a backup's record `meta`; a
    state that none claims is left unused."""
    states = meta.get("callbacks")
    if states is None and meta.get("history"):
        # A version 2 backup: the History record alone.
        states = {
            key: meta["history"]
            for key, callback in callbacks.items()
            if isinstance(callback, History)
        }
    for key, state in (states or {}).items():
        if key in callbacks:
            callbacks[key].load_state_dict(state)
