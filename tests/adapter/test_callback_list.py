"""The CallbackList of our Keras calls (`keras_accel.adapter.callback_list`): batch hooks that
no callback implements are not dispatched at all, and every callback sees what it sees under
Keras's own list (the same hooks, batches, logs and `params`), checked by running each call
both ways. One device, where our own data adapters feed Keras (on TensorFlow with XLA)."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter import callback_list
from tests.conftest import BACKEND

pytestmark = pytest.mark.torch

BATCH, ROWS = 8, 84  # 11 batches, the last padded: groups of 4, 4 and 3 steps.


def _data(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def _model(acc):
    keras.utils.set_random_seed(0)
    with acc.scope():
        model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
        # Our grouped adapter feeds compiled steps; on TensorFlow XLA ones (without XLA, a
        # tf.data pipeline), which Keras's "auto" leaves off on CPUs.
        jit = True if BACKEND == "tensorflow" else "auto"
        model.compile("sgd", "mse", metrics=["mae"], jit_compile=jit)
    return model


class Recorder(keras.callbacks.Callback):
    """Every hook it implements, with its batch, its logs and the list's `params`."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def _note(self, hook, index=None, logs=None):
        self.seen.append((hook, index, {k: float(v) for k, v in (logs or {}).items()}))

    def on_train_begin(self, logs=None):
        self.seen.append(("params", None, dict(self.params)))

    def on_train_batch_begin(self, batch, logs=None):
        self._note("train_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._note("train_end", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._note("test_end", batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._note("epoch_end", epoch, logs)


class OldBatchEnds(keras.callbacks.Callback):
    """Only Keras 2's `on_batch_end`, which Keras's `on_train_batch_end` calls."""

    def __init__(self):
        super().__init__()
        self.batches = []

    def on_batch_end(self, batch, logs=None):
        self.batches.append(batch)


class EpochsOnly(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.params_seen = []
        self.logs = []

    def on_train_begin(self, logs=None):
        self.params_seen.append(dict(self.params))

    def on_test_begin(self, logs=None):
        self.params_seen.append(dict(self.params))

    def on_epoch_end(self, epoch, logs=None):
        self.logs.append({k: float(v) for k, v in logs.items()})


def _both_ways(monkeypatch, call):
    """`call(acc)`'s result with our list, then with Keras's own (our `for_call` made to pass
    the callbacks on as they are), each on a fresh Accelerator and model."""
    results = [call(Accelerator(seed=0, devices=1, steps_per_execution=4))]
    with monkeypatch.context() as patch:
        patch.setattr(callback_list, "for_call", lambda model, callbacks, data, **_: callbacks)
        results.append(call(Accelerator(seed=0, devices=1, steps_per_execution=4)))
    return results


def _count_dispatches(monkeypatch):
    """Calls of Keras's own batch-end dispatch, per hook."""
    counts = {"on_train_batch_end": 0, "on_test_batch_end": 0, "on_predict_batch_end": 0}
    for hook in counts:
        original = getattr(keras.callbacks.CallbackList, hook)

        def counted(self, batch, logs=None, hook=hook, original=original):
            counts[hook] += 1
            return original(self, batch, logs)

        monkeypatch.setattr(keras.callbacks.CallbackList, hook, counted)
    return counts


def test_batch_hooks_no_callback_implements_are_not_dispatched(monkeypatch):
    counts = _count_dispatches(monkeypatch)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
    model = _model(acc)
    x, y = _data()
    epochs_only = EpochsOnly()
    history = acc.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        validation_data=_data(20, 1),
        callbacks=[epochs_only],
    )
    acc.evaluate(model, x, y, batch_size=BATCH, verbose=0)
    assert counts == {"on_train_batch_end": 0, "on_test_batch_end": 0, "on_predict_batch_end": 0}
    # Keras's History, returned and set on the model as Keras's own list does.
    assert history is model.history and history.epoch == [0, 1]
    assert [list(logs) for logs in epochs_only.logs] == [list(history.history)] * 2

    # One callback with a train batch end: Keras's dispatch again, for train batch ends only.
    recorder = OldBatchEnds()
    acc.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[recorder])
    assert counts["on_train_batch_end"] == 3 and counts["on_test_batch_end"] == 0
    # A hook given as an attribute (`LambdaCallback`'s) counts as one.
    seen = []
    hooks = keras.callbacks.LambdaCallback(on_test_batch_end=lambda b, logs: seen.append(b))
    acc.evaluate(model, x, y, batch_size=BATCH, verbose=0, callbacks=[hooks])
    assert counts["on_test_batch_end"] == 3 and seen == [3, 7, 11]
    # Each group's last step as Keras's epoch iterator numbers it (a short last group's
    # end counted as a whole group's), under Keras's own list too (the test below).
    assert recorder.batches == [3, 7, 11]


def test_callbacks_see_what_they_see_under_keras_s_own_list(monkeypatch):
    x, y = _data()

    def call(acc):
        model = _model(acc)
        recorder, old, epochs_only = Recorder(), OldBatchEnds(), EpochsOnly()
        history = acc.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            validation_data=_data(20, 1),
            callbacks=[recorder, old, epochs_only],
        )
        evaluated = EpochsOnly()
        result = acc.evaluate(
            model, x, y, batch_size=BATCH, verbose=0, callbacks=[evaluated], return_dict=True
        )
        return recorder.seen, old.batches, epochs_only, history.history, evaluated, result

    ours, keras_own = _both_ways(monkeypatch, call)
    assert ours[0] == keras_own[0]  # Hooks, batches, logs and params, in order.
    assert ours[0][0][2]["steps"] == 11 and any(h == "test_end" for h, _, _ in ours[0])
    assert ours[1] == keras_own[1]
    assert ours[2].params_seen == keras_own[2].params_seen and ours[2].logs == keras_own[2].logs
    assert ours[3] == keras_own[3]
    assert (
        ours[4].params_seen
        == keras_own[4].params_seen
        == [{"verbose": 0, "epochs": 1, "steps": 11}]
    )
    assert ours[5] == keras_own[5]


@pytest.mark.parametrize("limit", [None, 5])
def test_params_count_steps_as_keras_s_epoch_iterator(monkeypatch, limit):
    """`steps_per_epoch` given, and Keras's `max_steps_per_epoch` below the batches: the
    steps every callback is told are Keras's own count."""
    x, y = _data()
    previous = keras.config.max_steps_per_epoch()
    keras.config.set_max_steps_per_epoch(limit)
    try:

        def call(acc):
            model = _model(acc)
            seen = EpochsOnly()
            acc.fit(model, x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[seen])
            acc.fit(
                model,
                x,
                y,
                batch_size=BATCH,
                epochs=2,
                steps_per_epoch=8,
                verbose=0,
                callbacks=[seen],
            )
            acc.evaluate(model, x, y, batch_size=BATCH, steps=6, verbose=0, callbacks=[seen])
            return seen.params_seen

        ours, keras_own = _both_ways(monkeypatch, call)
    finally:
        keras.config.set_max_steps_per_epoch(previous)
    assert ours == keras_own
    assert [p["steps"] for p in ours] == ([11, 8, 6] if limit is None else [5, 5, 5])


def test_for_call_passes_other_data_and_a_user_s_list_as_they_are():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    callbacks = [EpochsOnly()]
    assert callback_list.for_call(model, callbacks, _data(), verbose=0) is callbacks
    given = keras.callbacks.CallbackList(callbacks)
    assert callback_list.for_call(model, given, object(), verbose=0) is given


def test_a_fit_whose_batch_hooks_are_skipped_logs_what_keras_s_list_logs(monkeypatch):
    x, y = _data()

    def call(acc):
        model = _model(acc)
        seen = EpochsOnly()
        history = acc.fit(
            model,
            x,
            y,
            batch_size=BATCH,
            epochs=2,
            verbose=0,
            validation_data=_data(20, 1),
            callbacks=[seen],
        )
        return seen.logs, history.history, [w.tolist() for w in model.get_weights()]

    ours, keras_own = _both_ways(monkeypatch, call)
    assert ours == keras_own and len(ours[0]) == 2 and "val_loss" in ours[0][0]


class _Counted(callback_list.PaddedBatchesAdapter):
    def __init__(self, batches, lazily=False):
        self.batches, self.counts_lazily = batches, lazily

    @property
    def num_batches(self):
        return self.batches


@pytest.mark.parametrize(
    "limit, steps, batches, want",
    [
        (None, None, 11, 11),
        (None, 8, 11, 8),
        (5, None, 11, 5),
        (5, 8, 11, 5),
        (9, 3, 11, 3),
        (None, None, None, None),
    ],
)
def test_keras_s_step_count(limit, steps, batches, want):
    """`EpochIterator.num_batches` of Keras 3.15: `steps` (clamped by the limit), else the
    adapter's count (None: unknown until an epoch ends)."""
    previous = keras.config.max_steps_per_epoch()
    keras.config.set_max_steps_per_epoch(limit)
    try:
        assert callback_list._keras_steps(_Counted(batches), steps) == want
    finally:
        keras.config.set_max_steps_per_epoch(previous)


def test_an_adapter_that_counts_only_inside_keras_s_call_keeps_keras_s_list():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    callbacks = [EpochsOnly()]
    assert (
        callback_list.for_call(model, callbacks, _Counted(4, lazily=True), verbose=0) is callbacks
    )
    made = callback_list.for_call(model, callbacks, _Counted(4), verbose=0, epochs=3)
    assert isinstance(made, callback_list.CallbackList) and made.params["steps"] == 4


class Listener(keras.callbacks.Callback):
    """A callback that asks which kinds' batch hooks its list dispatches (as the torch
    runtime's `StepLogsRead` does)."""

    def __init__(self):
        super().__init__()
        self.told = []

    def set_batch_hooks(self, hooked):
        self.told.append(dict(hooked))


def test_callbacks_that_ask_are_told_which_batch_hooks_their_list_dispatches():
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(1)])
    ends = keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: None)
    listener = Listener()
    made = callback_list.for_call(model, [ends, listener], _Counted(4), verbose=0)
    assert isinstance(made, callback_list.CallbackList)
    assert listener.told == [{"train": False, "test": True, "predict": False}]
    # Keras's own list, for data of another kind: what it will dispatch, its progress bar
    # (verbose on, none given) reading every kind.
    listener = Listener()
    callback_list.for_call(model, [OldBatchEnds(), listener], _data(), verbose=0)
    assert listener.told == [{"train": True, "test": False, "predict": False}]
    listener = Listener()
    callback_list.for_call(model, [listener], _data(), verbose=1)
    assert listener.told == [{"train": True, "test": True, "predict": True}]
