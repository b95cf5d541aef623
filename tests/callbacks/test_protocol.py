"""The public protocol between callbacks and the run (keras_accel.adapter.protocol), taken
part in by a user's own callbacks: fusion periods, the run context, saved callback state."""

import json
import weakref

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import (
    BackupAndRestore,
    History,
    RunContext,
    _callback_states,
    run_context,
)
from keras_accel.state import record as backup_record
from tests.helpers import Interrupt, compiled_mlp, data

DEVICES = 2  # What is checked is the host loop, not the step.


def _fresh():
    """A compiled model named as in a new process (Keras numbers layers on per session)."""
    keras.backend.clear_session(free_memory=False)
    return compiled_mlp()


class _EveryFourth(keras.callbacks.Callback):
    """A user's callback: batch ends in groups of 4, and the run's context."""

    def __init__(self):
        super().__init__()
        self.ends, self.contexts, self.exits = [], [], []

    def fusion_period(self, kind, steps):
        return 4 if kind == "train" else None

    def set_run_context(self, context):
        self.contexts.append(
            (
                context.kind,
                context.epochs,
                context.steps,
                context.total_steps,
                context.steps_per_execution,
                context.process_index,
                context.num_processes,
                context.is_chief,
            )
        )
        context.call_on_exit(lambda: self.exits.append(context.kind))

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_a_users_callback_asks_for_period_four_and_receives_the_context():
    acc = Accelerator(seed=0, devices=DEVICES)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(16 * 12)  # 12 steps an epoch.
    callback = _EveryFourth()
    acc.fit(model, x, y, batch_size=16, epochs=2, verbose=0, callbacks=[callback])
    assert callback.ends == [3, 7, 11] * 2
    assert callback.contexts == [("train", 2, 12, 24, 4, 0, 1, True)]
    assert callback.exits == ["train"]  # After the call, however it ended.
    context = run_context(model)
    assert isinstance(context, RunContext) and context.model is model
    # The call's facts are the call's: put back after it.
    assert (context.kind, context.epochs, context.steps) == (None, None, None)
    assert context.steps_per_execution == 1
    with pytest.raises(RuntimeError, match="call_on_exit"):
        context.call_on_exit(lambda: None)

    # evaluate asks for "test": no constraint from this callback, the call's own facts.
    acc.evaluate(model, x, y, batch_size=16, verbose=0, callbacks=[callback])
    assert callback.contexts[-1][:3] == ("test", None, 12)
    assert callback.exits == ["train", "test"]


def test_a_callback_without_the_protocol_is_unchanged():
    """No method, no change: batch hooks still turn fusion off, as before."""
    acc = Accelerator(seed=0, devices=DEVICES)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(16 * 6)
    seen = []
    hooks = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: seen.append(b))
    acc.fit(model, x, y, batch_size=16, epochs=1, verbose=0, callbacks=[hooks])
    assert seen == list(range(6))


class _Counter(keras.callbacks.Callback):
    """A user's stateful callback: training batches seen, counted across resumes."""

    def __init__(self, state_key=None):
        super().__init__()
        self.batches, self.loaded = 0, None
        if state_key is not None:
            self.state_key = state_key

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.loaded = dict(state)
        self.batches = state["batches"]


@pytest.mark.parametrize("where", ["before", "after"])
def test_backup_saves_and_restores_a_users_callback_state(tmp_path, where):
    x, y = data(40)  # 2 batches an epoch (batch_size 32).
    backup = BackupAndRestore(str(tmp_path / "backup"))
    counter = _Counter()
    first = [counter, backup] if where == "before" else [backup, counter]
    with pytest.raises(KeyboardInterrupt):
        _fresh().fit(x, y, epochs=4, verbose=0, callbacks=[*first, Interrupt(2)])
    backup.wait()
    # Batch ends run before the epoch's end, where the backup is taken: all 4 are in.
    resumed = _Counter()
    again = [resumed, backup] if where == "before" else [backup, resumed]
    _fresh().fit(x, y, epochs=4, verbose=0, callbacks=again)
    assert resumed.loaded == {"batches": 4}
    assert resumed.batches == 8  # Every batch of the 4 epochs, once.


def test_epoch_end_state_is_in_the_backup_whatever_the_order(tmp_path):
    """The backup's on_epoch_end runs first; the run context says which epoch ended."""

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.done = []

        def on_train_begin(self, logs=None):
            self.context = run_context(self.model)

        def on_epoch_end(self, epoch, logs=None):
            if epoch not in self.done:
                self.done.append(epoch)

        def state_dict(self):
            if self.context.epoch_end is not None:
                self.on_epoch_end(*self.context.epoch_end)
            return {"done": list(self.done)}

        def load_state_dict(self, state):
            self.done = list(state["done"])

    x, y = data(40)
    backup = BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(KeyboardInterrupt):
        _fresh().fit(x, y, epochs=4, verbose=0, callbacks=[backup, Epochs(), Interrupt(2)])
    backup.wait()
    resumed, history = Epochs(), History()
    _fresh().fit(x, y, epochs=4, verbose=0, callbacks=[backup, resumed, history])
    assert resumed.done == [0, 1, 2, 3]
    assert history.epoch == [2, 3]  # Keras's History-less first run left no record.


def test_replayed_batches_are_public(tmp_path):
    """A mid-epoch resume re-runs the epoch's first batches; a user's callback can skip them
    with `run_context(model).replaying`, as keras_accel's do."""

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.batches = []

        def on_train_begin(self, logs=None):
            self.context = run_context(self.model)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            if not self.context.replaying(self.epoch, batch):
                self.batches.append((self.epoch, batch))

    class Crash(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if (self.epoch, batch) == (1, 3):
                raise KeyboardInterrupt

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    x, y = data(48)  # 6 batches of 8 an epoch; backups every 2 batches.
    backup = BackupAndRestore(str(tmp_path / "backup"), save_freq=2)
    first = Seen()
    with pytest.raises(KeyboardInterrupt):
        _fresh().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[backup, first, Crash()])
    backup.wait()
    second = Seen()
    _fresh().fit(x, y, batch_size=8, epochs=2, verbose=0, callbacks=[backup, second])
    # The backup after batch 3 (4 done) of epoch 1; batches 0-3 re-run, unseen.
    assert second.batches == [(1, 4), (1, 5)]
    assert run_context(backup._model).resumed_at is None  # Cleared when the fit ends.


def test_two_callbacks_with_one_state_key_are_refused(tmp_path):
    x, y = data(40)
    callbacks = [BackupAndRestore(str(tmp_path / "backup")), _Counter(), _Counter()]
    with pytest.raises(RuntimeError, match="same key '_Counter'"):
        _fresh().fit(x, y, epochs=1, verbose=0, callbacks=callbacks)
    # A distinct state_key each: both saved.
    backup = BackupAndRestore(str(tmp_path / "other"), delete_checkpoint=False)
    a, b = _Counter("a"), _Counter("b")
    _fresh().fit(x, y, epochs=1, verbose=0, callbacks=[backup, a, b])
    meta = backup._backups.open().read_meta(backup._backups.open().steps()[-1])
    assert meta["version"] == 3
    assert meta["callbacks"]["a"] == {"batches": 2} and meta["callbacks"]["b"] == {"batches": 2}
    assert "History" not in meta["callbacks"]  # Keras's own History has no state_dict.


def test_a_state_that_is_not_json_is_refused_naming_the_callback(tmp_path):
    class Bad(_Counter):
        def state_dict(self):
            return {"array": np.ones(2)}

    x, y = data(40)
    with pytest.raises(TypeError, match="'Bad' cannot be saved: it must be JSON-able"):
        _fresh().fit(
            x, y, epochs=1, verbose=0, callbacks=[BackupAndRestore(str(tmp_path / "b")), Bad()]
        )


def test_a_version_2_backup_gives_its_history_record_to_the_history():
    """Backups written before the protocol kept the History record under "history"."""
    record = History()
    record.finish_epoch(0, {"loss": 1.0})
    backup = BackupAndRestore("/tmp/unused-keras-accel-protocol")
    history, counter = History(), _Counter()
    others = [weakref.ref(c) for c in (backup, history, counter)]
    saved = json.loads(json.dumps(record.to_dict()))
    stateful = _callback_states.stateful(backup, None, others)
    _callback_states.load({"version": 2, "history": saved}, stateful)
    assert history.epoch == [0] and history.history["loss"] == [1.0]
    assert counter.loaded is None


def test_a_backup_of_a_later_format_is_refused_before_anything_is_restored():
    backup_record.check_version({"version": 3}, "b/12")  # This format: read.
    with pytest.raises(ValueError, match=r"'b/12' is of format version 99, written by keras_accel"
                       r" 9.0; this keras_accel reads versions up to 3. Upgrade"):  # fmt: skip
        backup_record.check_version({"version": 99, "keras_accel_version": "9.0"}, "b/12")
