"""What the keras_accel callbacks of one `fit` tell each other, per model.

Callbacks run in the order the user lists them, so none may rely on another having run
first. The few facts they share (a mid-epoch resume in progress, the rate the scheduler
applied) live in one small object per model, kept here, beside the model rather than on it:
nothing is added to the user's model, and the record goes when the model does.
"""

from __future__ import annotations

import dataclasses
import weakref

_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass
class RunState:
    # Set by BackupAndRestore on a mid-epoch resume: batches of `replay_epoch` before
    # `replay_batch` re-run only to reach the restored position, then their effect is
    # overwritten by the restored state. Other callbacks ignore them.
    replay_epoch: int | None = None
    replay_batch: int = 0
    # Where the restored checkpoint left off: (epoch, batches done in it).
    resumed_at: tuple[int, int] | None = None
    # The rate LearningRateScheduler applied last, and the optimizer step it was for.
    learning_rate: float | None = None
    learning_rate_step: int | None = None
    # Bumped by BackupAndRestore whenever it assigns restored variables: a sign for
    # callbacks that count steps on the host to read the optimizer's count again.
    restores: int = 0

    def replaying(self, epoch: int | None, batch: int) -> bool:
        """Whether `batch` of `epoch` is a replayed batch of a mid-epoch resume."""
        return (
            self.replay_epoch is not None
            and epoch == self.replay_epoch
            and (batch < self.replay_batch)
        )


def run_state(model) -> RunState:
    """The model's shared state, created on first use. Never syncs JAX state: pass the raw
    model (`callback._model`), not `callback.model`."""
    state = _STATES.get(model)
    if state is None:
        state = _STATES[model] = RunState()
    return state
