"""Class and module attributes of Keras that calls running at once share.

They are replaced when the first call that needs them enters and given back when the last
one leaves, under one lock, so that two calls in two threads never restore each other's
wrappers. The replacements act only under a strategy of a running call (`ours`, by id, with
a count); under any other (a plain model.fit in another thread, under the user's own
strategy), Keras's own code runs, unchanged.
"""

from __future__ import annotations

import threading

import tensorflow as tf

from keras_accel.adapter.patches import Patches

_LOCK = threading.Lock()
_SHARED: dict[str, list] = {}  # name -> [the Patches that installed it, calls using it]
_OURS: dict[int, int] = {}  # id(strategy) -> calls running under it


def share(patches: Patches, strategy, name: str, install) -> None:
    """`install(own_patches)` unless a running call did; undone (with `patches`) when the
    last call using it ends. `strategy` is this call's: the replacements act under it."""
    with _LOCK:
        entry = _SHARED.get(name)
        if entry is None:
            own = Patches()
            try:
                install(own)
            except BaseException:
                own.restore()
                raise
            entry = _SHARED[name] = [own, 0]
        entry[1] += 1
        _OURS[id(strategy)] = _OURS.get(id(strategy), 0) + 1

    def release() -> None:
        with _LOCK:
            left = _OURS.pop(id(strategy)) - 1
            if left:
                _OURS[id(strategy)] = left
            entry[1] -= 1
            if entry[1] == 0:
                del _SHARED[name]
                entry[0].restore()

    patches.add(release)


def running_under(strategy) -> bool:
    """Whether a running call of ours registered `strategy`."""
    return id(strategy) in _OURS


def ours() -> bool:
    """Whether the strategy in scope is one a running call of ours registered."""
    return running_under(tf.distribute.get_strategy())
