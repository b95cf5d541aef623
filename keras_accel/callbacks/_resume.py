"""Where a restore puts a fit: the epoch Keras starts at (`model._initial_epoch`, through
`keras_internals`), the model's run context (`resumed_at`, `restores`, `began_late`, the
replayed batches), and, after a backup taken `k` batches into an epoch, one of two ways on:

- **begun late** (`Accelerator.fit` over data read by position: arrays, memory maps,
  array-likes, a `PyDataset`): the fit's data begins that epoch at batch `k`
  (`RunContext.begin_epoch_at`, `keras_accel.data.start`), nothing is computed for
  batches `0..k-1`. Keras runs an epoch of the remaining batches and numbers them from 0;
  the fit's CallbackList is told to number them from `k` (an instance patch for that
  epoch), so every callback (Keras's progress bar too) sees the uninterrupted run's
  numbers. Keras resets the metrics as the epoch begins: their restored totals (the first
  `k` batches' share) are assigned again then, so the epoch's logs are the whole epoch's.
  Keras's "Your input ran out of data" at that epoch's early end is silenced for it.
- **replayed** (anything else: `model.fit`, generators, tf.data): the epoch's first
  batches run again, and the state is assigned again when they reach the backup's
  position (their effect overwritten);

each undone when the fit ends."""

from __future__ import annotations

import warnings

from keras_accel.adapter.protocol import run_context
from keras_accel.state import tree
from keras_accel.utils import keras_internals

# Keras's `EpochIterator` warns so when an epoch's data ends before the batches it counted
# for the whole epoch: an epoch begun late ends that way by design.
_RAN_OUT = "Your input ran out of data"


class Resume:
    """The resume of one callback's fits."""

    def __init__(self):
        self.replay: dict | None = None  # The state to assign again at the replay's end.
        self.sets_initial_epoch = False  # A restore set `model._initial_epoch` for Keras.
        # An epoch begun late: {"epoch", "batch", "metrics": (variables, values)}.
        self.late: dict | None = None
        self._numbering = None  # (CallbackList, its batch hooks before we numbered them).
        self._silence = None  # The warnings' state saved while Keras's early epoch end is silent.

    def begin(self, model) -> None:
        """A fit starts: one that a mid-epoch replay's fit left pending starts anew."""
        self.replay = None
        self._end_late()
        context = run_context(model)
        context.replay_epoch = None
        context.resumed_at = None  # A restore sets it again; an earlier fit's is gone.
        context.began_late = None

    def restored(self, model, meta: dict, restored: dict, calls=None) -> None:
        """The backup of record `meta` was restored into the variables `restored` (and its
        random generator states and callbacks' states given back). `calls`: the fit's
        CallbackList (None: hooks called directly)."""
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        self._start_at(model, epoch, batch)
        if batch and self._begin_late(model, meta, restored, calls):
            return
        if batch:
            context = run_context(model)
            context.replay_epoch, context.replay_batch = epoch, batch
            self.replay = {
                "values": tree.snapshot(restored),
                "rng": meta["rng"],
                "manifest": meta["manifest"],
            }

    def _begin_late(self, model, meta: dict, restored: dict, calls) -> bool:
        """Have the fit begin the backup's epoch at its batch, where its data can (see the
        module docstring); False where it cannot (then those first batches are replayed)."""
        epoch, batch = int(meta["epoch"]), int(meta["batch"])
        context = run_context(model)
        metrics = {key: v for key, v in restored.items() if key.startswith("metrics/")}
        if calls is None or not context.begin_epoch_at(epoch, batch):
            return False
        self.late = {
            "epoch": epoch,
            "batch": batch,
            "metrics": (metrics, tree.snapshot(metrics)),
            "rng": meta["rng"],
        }
        context.began_late = (epoch, batch)
        stop_at = context.steps - 1 if context.late_epoch_stops and context.steps else None
        self._number_from(calls, model, batch, stop_at)
        # Python's own save and restore of the filters (public, and it rebuilds the warning
        # caches itself); undone when the late epoch ends.
        self._silence = warnings.catch_warnings()
        self._silence.__enter__()
        warnings.filterwarnings("ignore", message=_RAN_OUT, category=UserWarning)
        return True

    def _number_from(self, calls, model, batch: int, stop_at: int | None) -> None:
        """The fit's list hands its callbacks batch numbers `batch` higher (Keras numbers
        the late epoch's batches from 0) until `_end_late`: instance patches. With
        `stop_at` (the epoch's last batch), Keras's loop is stopped after that batch
        (`model.stop_training`, set back as the epoch ends, before the callbacks' own
        `on_epoch_end` may set it)."""
        names = ("on_train_batch_begin", "on_train_batch_end", "on_epoch_end")
        before = {name: calls.__dict__.get(name) for name in names}
        begin, end, epoch_end = (getattr(calls, name) for name in names)
        stopped = []

        def batch_begin(step, logs=None):
            return begin(step + batch, logs)

        def batch_end(step, logs=None):
            result = end(step + batch, logs)
            if stop_at is not None and step + batch >= stop_at and not model.stop_training:
                model.stop_training = True
                stopped.append(True)
            return result

        def on_epoch_end(epoch, logs=None):
            if stopped:
                model.stop_training = False
                stopped.clear()
            return epoch_end(epoch, logs)

        calls.on_train_batch_begin = batch_begin
        calls.on_train_batch_end = batch_end
        calls.on_epoch_end = on_epoch_end
        self._numbering = (calls, before)

    def _end_late(self) -> None:
        """The late epoch ended (or the fit did): batches numbered as Keras numbers them,
        Keras's warning back."""
        self.late = None
        numbering, self._numbering = self._numbering, None
        if numbering is not None:
            calls, before = numbering
            for name, hook in before.items():
                if hook is None:
                    calls.__dict__.pop(name, None)
                else:
                    setattr(calls, name, hook)
        silence, self._silence = self._silence, None
        if silence is not None:
            silence.__exit__(None, None, None)

    def batch_began(self) -> None:
        """The late epoch's first step is next: the random generators (Python, NumPy,
        torch's global one) as the backup left them. Making the epoch's data iterator drew
        from them since the restore (Keras's torch DataLoader draws its base seed), which
        the uninterrupted run drew before the backup."""
        rng = None if self.late is None else self.late.pop("rng", None)
        if rng is not None:
            tree.set_rng_state(rng)

    def epoch_ended(self, epoch: int) -> None:
        if self.late is not None and epoch == self.late["epoch"]:
            self._end_late()

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

    def epoch_began(self, model, epoch: int) -> None:
        late = self.late
        if late is not None and epoch == late["epoch"]:
            # Keras reset the metrics as the epoch began: the first batches' totals back.
            variables, values = late["metrics"]
            tree.assign(variables, values)
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
        context.began_late = None
        self.replay = None
        self._end_late()

    def abandon(self, model) -> None:
        """A fit ended without `on_train_end`: the epoch a restore set is cleared."""
        if self.sets_initial_epoch and model is not None:
            keras_internals.set_initial_epoch(model, None)
        self.sets_initial_epoch = False
        self.replay = None
        self._end_late()
        if model is not None:
            run_context(model).began_late = None
