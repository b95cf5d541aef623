"""Where a restore puts a fit: the epoch Keras starts at (`model._initial_epoch`, through
`keras_internals`), the model's run context (`resumed_at`, `restores`, the replayed batches),
and, after a backup taken mid-epoch, the state assigned again when the re-run batches reach
the backup's position (the mid-epoch replay); each undone when the fit ends."""

from __future__ import annotations

from keras_accel.adapter.protocol import run_context
from keras_accel.state import tree
from keras_accel.utils import keras_internals


class Resume:
    """The resume of one callback's fits."""

    def __init__(self):
        self.replay: dict | None = None  # The state to assign again at the replay's end.
        self.sets_initial_epoch = False  # A restore set `model._initial_epoch` for Keras.

    def begin(self, model) -> None:
        """A fit starts: one that a mid-epoch replay's fit left pending starts anew."""
        self.replay = None
        context = run_context(model)
        context.replay_epoch = None
        context.resumed_at = None  # A restore sets it again; an earlier fit's is gone.

    def restored(self, model, meta: dict, restored: dict) -> None:
        """The backup of record `meta` was restored into the variables `restored` (and its
        random generator states and callbacks' states given back)."""
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        self._start_at(model, epoch, batch)
        if batch:
            context = run_context(model)
            context.replay_epoch, context.replay_batch = epoch, batch
            self.replay = {
                "values": tree.snapshot(restored),
                "rng": meta["rng"],
                "manifest": meta["manifest"],
            }

    def restored_keras(self, model, epoch: int) -> None:
        """A Keras backup was loaded: its epoch starts again from its first batch."""
        self._start_at(model, epoch, 0)

    def _start_at(self, model, epoch: int, batch: int) -> None:
        keras_internals.set_initial_epoch(model, epoch)
        self.sets_initial_epoch = True
        context = run_context(model)
        context.resumed_at = (epoch, batch)
        context.restores += 1

    def replaying(self, model, epoch: int, batches: int) -> bool:
        """Whether `batches` batches into `epoch` are still before the restored position."""
        return self.replay is not None and run_context(model).replaying(epoch, batches)

    def finish_replay(self, model) -> None:
        """The re-run batches reached the backup's position: assign its state again.
        `model`: the callback's `model`, which on JAX pulls the training state onto the
        variables first."""
        replay, self.replay = self.replay, None
        state = tree.keyed_as(model, tree.variables(model), replay["manifest"])
        tree.assign(state, replay["values"])
        tree.set_rng_state(replay["rng"])
        # `replay_epoch` stays set until the epoch ends: callbacks after this one in the
        # list must still see this batch as a replayed one.
        run_context(model).restores += 1

    def epoch_began(self, model) -> None:
        if self.sets_initial_epoch:
            # Keras read the epoch to start at before the first epoch began: nothing needs
            # it now, and a later fit would skip epochs (a fit that raises never gets to
            # `on_train_end`, where it is cleared too).
            keras_internals.set_initial_epoch(model, None)
            self.sets_initial_epoch = False

    def end(self, model) -> None:
        """The fit ended: Keras never clears the epoch a restore set (a later fit would
        skip epochs), nor our run context."""
        keras_internals.set_initial_epoch(model, None)
        self.sets_initial_epoch = False
        context = run_context(model)
        context.resumed_at = None
        context.replay_epoch = None
        self.replay = None

    def abandon(self, model) -> None:
        """A fit ended without `on_train_end`: the epoch a restore set is cleared."""
        if self.sets_initial_epoch and model is not None:
            keras_internals.set_initial_epoch(model, None)
        self.sets_initial_epoch = False
        self.replay = None
