"""The one fact two keras_accel callbacks pass each other privately, per model.

Everything a callback may know about the run is public: `keras_accel.callbacks.RunContext`
(`keras_accel.adapter.protocol`). What stays here is not run context but one callback's
output for another, kept private on purpose: the rate `LearningRateScheduler` applied at
this step, which `History(per_step=True)` records. The scheduler also puts it in the batch's
logs (where any callback reads it), but only in its own `on_train_batch_end`, so a History
listed before the scheduler would miss it; reading it from the optimizer instead would copy
the JAX training state back to the host at every step. Kept beside the model rather than on
it: nothing is added to the user's model, and the record goes when the model does.
"""

from __future__ import annotations

import dataclasses
import weakref

_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class RunState:
    # The rate LearningRateScheduler applied last.
    learning_rate: float | None = None


def run_state(model) -> RunState:
    """The model's shared state, created on first use. Never syncs JAX state: pass the raw
    model (`callback._model`), not `callback.model`."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = RunState()
    return state
