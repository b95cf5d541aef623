"""The public protocol between callbacks and the run: `RunContext`, and four optional methods.

Keras hands a callback the model (`set_model`), Keras's `params` (`set_params`) and the logs
of each hook. keras_accel adds what a callback cannot learn from those: how many steps one
host call runs, which batches a resumed run skips or re-runs, the processes. Any
`keras.callbacks.Callback` may define any of these methods; none is required, and a
callback that defines none behaves exactly as under Keras:

- `fusion_period(kind, steps) -> int | None`: the step periods this callback needs under
  host-loop fusion (`keras_accel.adapter.fusion`). `kind` is "train", "test" or "predict"
  (a fit asks for "test" too when it validates), `steps` the steps of one epoch (or of the
  evaluation) where known. Return None for "any number of steps per host call", 1 for
  "every batch", N for "groups that end on multiples of N" (the Accelerator fuses the
  largest divisor of every callback's N, at most 32). Without the method, a callback that
  overrides a batch hook of that kind is taken to need every batch.
- `set_run_context(context)`: called by `Accelerator.fit`, `evaluate` and `predict` on each
  of the call's callbacks before Keras's loop starts (before `set_model`), with the model's
  `RunContext` holding this call's facts. `context.call_on_exit(fn)` runs `fn()` when the
  call ends, however it ends (Keras skips `on_train_end` when `fit` raises).
- `state_dict() -> dict` and `load_state_dict(state)`: the callback's own state, which
  `keras_accel.callbacks.BackupAndRestore` saves with every backup and gives back on resume
  (Lightning's `Callback.state_dict`/`load_state_dict`). See `RunContext.epoch_end` for
  what a backup at an epoch's end means for a callback that runs after it.

Example:

>>> import keras
>>> from keras_accel.callbacks import run_context
>>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
>>> context = run_context(model)
>>> context is run_context(model), context.steps_per_execution, context.resumed_at
(True, 1, None)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from keras_accel.utils import process

KINDS = ("train", "test", "predict")
_CONTEXTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class RunContext:
    """What a callback may know about the run of one model: one object for the model's life,
    kept up to date in place (look it up once with `run_context(model)` and keep it).

    Every attribute is set by keras_accel; callbacks read them.

    The call in progress (set by `Accelerator.fit`, `evaluate` and `predict` for the length
    of the call, and put back after it, so a call made inside another's callback sees its
    own; None under a plain `model.fit`, where Keras's `self.params` has `epochs` and
    `steps`):

    Attributes:
        kind: "train", "test" or "predict".
        epochs: the fit's `epochs` (None for evaluate and predict).
        steps: steps per epoch (or of the evaluation), where known.

    Where a resume stands (set by `BackupAndRestore` when it restores, under `model.fit`
    and `Accelerator.fit` alike):

    Attributes:
        resumed_at: `(epoch, batch)` where the restored backup left off (batches done in
            that epoch), for the fit that restored it; None otherwise.
        restores: how many times variables were assigned from a backup (a restore, and the
            end of a mid-epoch replay): a callback that counts steps on the host reads the
            optimizer's count again when this changes.
        began_late: `(epoch, batch)` where this fit began `epoch` at `batch` (a mid-epoch
            resume under `Accelerator.fit` over data read by position): batches before it
            were not run in this fit, and callbacks see the batches from `batch` on, with
            the uninterrupted run's numbers; None otherwise.
        replay_epoch, replay_batch: during a mid-epoch resume that cannot begin late, the
            batches of `replay_epoch` before `replay_batch` only re-run to reach the
            restored position (their effect is overwritten); `replaying(epoch, batch)`
            says whether a batch is one of them (never, in an epoch begun late).
        late_epoch_stops: set by the Accelerator for a fit that can begin an epoch late:
            whether Keras's loop is stopped at that epoch's last batch (TensorFlow, whose
            steps read their batch inside the step) rather than at the data's end.
        epoch_end: `(epoch, logs)` while `BackupAndRestore` takes a backup at the end of
            `epoch` (the logs Keras passes to every `on_epoch_end`), else None. The backup
            is taken in its own `on_epoch_end`, which may run before yours: a callback
            whose state changes at an epoch's end can bring `state_dict()` up to date from
            it (`History` does), so the backup holds that epoch whatever the order.

    Set by the runtime for the call, where each process holds its own share of the
    metrics' state (torch over processes; None elsewhere):

    Attributes:
        metric_state: `for_backup(state)` gives `state` (`{key: variable}`) with the
            metrics' variables as the values one process would hold (every process's
            share reduced: a collective), `after_restore(state)` gives each process back
            its share of such values (`keras_accel.callbacks.BackupAndRestore`).

    Example:

    >>> import keras, numpy as np
    >>> from keras_accel.callbacks import run_context
    >>> class SkipsReplayedBatches(keras.callbacks.Callback):
    ...     def on_train_begin(self, logs=None):
    ...         self.context, self.epoch, self.seen = run_context(self.model), None, []
    ...     def on_epoch_begin(self, epoch, logs=None):
    ...         self.epoch = epoch
    ...     def on_train_batch_end(self, batch, logs=None):
    ...         if not self.context.replaying(self.epoch, batch):
    ...             self.seen.append((self.epoch, batch))
    >>> model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> callback = SkipsReplayedBatches()
    >>> _ = model.fit(np.ones((4, 2)), np.ones((4, 1)), batch_size=2, verbose=0,
    ...               callbacks=[callback])
    >>> callback.seen
    [(0, 0), (0, 1)]
    """

    def __init__(self, model):
        self._model = weakref.ref(model)
        self.kind: str | None = None
        self.epochs: int | None = None
        self.steps: int | None = None
        self.resumed_at: tuple[int, int] | None = None
        self.restores = 0
        self.began_late: tuple[int, int] | None = None
        self.replay_epoch: int | None = None
        self.replay_batch = 0
        # Set by the Accelerator for a fit whose data can begin an epoch part-way.
        self._begin_epoch_at: Callable[[int, int], bool] | None = None
        self.late_epoch_stops = False
        self.epoch_end: tuple[int, dict] | None = None
        self.metric_state = None
        self._on_exit: Callable[[Callable[[], None]], None] | None = None

    @property
    def model(self):
        """The model (held weakly: the context goes when the model does)."""
        return self._model()

    @property
    def steps_per_execution(self) -> int:
        """Steps per host call: batch hooks fire once every this many steps."""
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    @property
    def total_steps(self) -> int | None:
        """`epochs * steps` of the fit in progress, where both are known."""
        if self.kind != "train" or not self.epochs or not self.steps:
            return None
        return int(self.epochs) * int(self.steps)

    @property
    def process_index(self) -> int:
        """This process's index among the run's processes (0 is the chief)."""
        return process.process_index()

    @property
    def num_processes(self) -> int:
        """How many processes run this training (1 on one host without a cluster)."""
        return process.num_processes()

    @property
    def is_chief(self) -> bool:
        """Whether this process writes the run's files (keras_accel's callbacks write from
        the chief only)."""
        return process.is_chief()

    def replaying(self, epoch: int | None, batch: int) -> bool:
        """Whether `batch` of `epoch` is a re-run batch of a mid-epoch resume."""
        if self.replay_epoch is None or epoch != self.replay_epoch:
            return False
        return batch < self.replay_batch

    def begin_epoch_at(self, epoch: int, batch: int) -> bool:
        """Ask the fit in progress to begin `epoch` at `batch` (its first `batch` batches
        not run): True where its data will (`Accelerator.fit` over arrays, memory maps,
        array-likes or a `PyDataset`, epochs of whole passes, `batch` at the end of a
        host call; not what Keras reads through its own PyDataset adapter on one
        TensorFlow device, `run.begin_late`), False elsewhere (then nothing changed). For
        `BackupAndRestore`."""
        begin = self._begin_epoch_at
        return begin is not None and bool(begin(int(epoch), int(batch)))

    def call_on_exit(self, function: Callable[[], None]) -> None:
        """Run `function()` when the Accelerator call in progress ends, however it ends
        (newest first, with the call's own undos). Only during such a call (in
        `set_run_context` and the call's hooks).

        Raises:
            RuntimeError: no Accelerator call is in progress for this model.
        """
        if self._on_exit is None:
            raise RuntimeError(
                "RunContext.call_on_exit works during an Accelerator.fit, evaluate or "
                "predict of this model only (in set_run_context or the call's hooks); "
                "none is in progress. Under a plain model.fit, undo in on_train_end."
            )
        self._on_exit(function)

    def begin(self, patches, kind: str, epochs=None, steps=None) -> None:
        """The Accelerator's side (`begin_call`): this call's facts, and `call_on_exit`
        routed to the call's undos, until `patches` are restored."""
        patches.set(self, "kind", kind)
        patches.set(self, "epochs", None if epochs is None else int(epochs))
        patches.set(self, "steps", None if steps is None else int(steps))
        patches.set(self, "_on_exit", patches.add)
        patches.set(self, "_begin_epoch_at", None)  # A fit that can says so (`can_begin_late`).

    def can_begin_late(self, patches, begin: Callable[[int, int], bool], stops: bool) -> None:
        """The Accelerator's side: this fit's data begins an epoch part-way with
        `begin(epoch, batch) -> bool`, until `patches` are restored. `stops`: Keras's loop
        must be stopped at that epoch's last batch (`late_epoch_stops`), rather than
        find the data's end."""
        patches.set(self, "_begin_epoch_at", begin)
        patches.set(self, "late_epoch_stops", bool(stops))

    def __repr__(self) -> str:
        return (
            f"RunContext(kind={self.kind!r}, epochs={self.epochs}, steps={self.steps}, "
            f"steps_per_execution={self.steps_per_execution}, resumed_at={self.resumed_at}, "
            f"process_index={self.process_index}, num_processes={self.num_processes})"
        )


def run_context(model) -> RunContext:
    """The `RunContext` of `model`, created on first use; the same object for the model's
    life. Nothing is added to the model. On JAX, `callback.model` copies the training state
    onto the variables: look the context up once (`on_train_begin`) rather than per batch.
    """
    context = _CONTEXTS.get(model)
    if context is None:
        context = _CONTEXTS[model] = RunContext(model)
    return context


def begin_call(patches, model, kind: str, epochs=None, steps=None) -> RunContext:
    """The Accelerator's side: the call's facts on the model's context until `patches`
    are restored, and `call_on_exit` routed to them."""
    if kind not in KINDS:
        raise ValueError(f"`kind` must be one of {KINDS}. Received: kind={kind!r}")
    context = run_context(model)
    context.begin(patches, kind, epochs, steps)
    return context
