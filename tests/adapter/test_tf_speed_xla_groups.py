"""On one TensorFlow device a model compiled with `jit_compile=True` runs each fused group of
steps as one XLA program (`keras_accel.adapter.backends.tensorflow.fused.GroupRunner`) instead
of one XLA launch per step: its rows gathered in the program where they are arrays and the
epochs whole passes (`keras_accel.data.groups.RowGroups`), its batches read on the host and
stacked otherwise: every number must be the one the per-step launches give."""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="TensorFlow's fused steps"
)


def _run(monkeypatch, mode: str, dropout: bool, rows: int, spe, **fit_kwargs):
    """mode: "pipeline" (arrays gathered a group at a time in the program), "reads" (the
    group's batches read one by one on the host, then run as one XLA program) or
    "launches" (one XLA launch per step)."""
    from keras_accel.adapter.backends.tensorflow import fused
    from keras_accel.adapter.backends.tensorflow.runtime import Runtime

    calls = []
    run_batches, run_group = fused.GroupRunner.run_batches, fused.GroupRunner.run_group

    def spy_run_batches(self, iterator, n):
        calls.append(("reads", mode == "reads"))
        if mode == "reads":
            return run_batches(self, iterator, n)
        outputs = None
        for _, batch in zip(range(n), iterator):  # One launch per step: groups of one.
            outputs = run_batches(self, iter([batch]), 1)
        if outputs is None:
            raise StopIteration
        return outputs

    def spy_run_group(self, iterator):
        calls.append(("pipeline", True))
        return run_group(self, iterator)

    monkeypatch.setattr(fused.GroupRunner, "run_batches", spy_run_batches)
    monkeypatch.setattr(fused.GroupRunner, "run_group", spy_run_group)
    if mode != "pipeline":
        monkeypatch.setattr(Runtime, "grouped", lambda *args, **kwargs: None)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 12)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 5, rows), 5)
    keras.utils.set_random_seed(1)
    acc = Accelerator(seed=0, devices=1, steps_per_execution=spe)
    with acc.scope():
        layers = [keras.Input((12,)), keras.layers.Dense(16, activation="relu")]
        if dropout:
            layers.append(keras.layers.Dropout(0.3))
        model = keras.Sequential([*layers, keras.layers.Dense(5, activation="softmax")])
        model.compile(
            keras.optimizers.Adam(1e-2),
            "categorical_crossentropy",
            metrics=["accuracy"],
            jit_compile=True,
        )
    history = acc.fit(
        model,
        x,
        y,
        batch_size=16,
        epochs=3,
        verbose=0,
        validation_data=(x[:40], y[:40]),
        **fit_kwargs,
    )
    evaluation = acc.evaluate(model, x, y, batch_size=16, verbose=0)
    monkeypatch.undo()
    return model.get_weights(), history.history, evaluation, calls


@pytest.mark.parametrize(
    "mode,dropout,rows,spe,fit_kwargs",
    [
        ("pipeline", False, 200, "auto", {}),
        ("pipeline", True, 200, 4, {"initial_epoch": 1}),  # Groups from the resumed epoch.
        ("pipeline", False, 64, 3, {}),
        ("reads", True, 200, 4, {"steps_per_epoch": 8}),  # Not whole passes: read one by one.
    ],
)
def test_xla_groups_compute_what_per_step_launches_do(
    monkeypatch, mode, dropout, rows, spe, fit_kwargs
):
    weights, history, evaluation, calls = _run(monkeypatch, mode, dropout, rows, spe, **fit_kwargs)
    assert calls and all(taken for _, taken in calls)  # One XLA program per group,
    assert {how for how, _ in calls} == {mode}  # its batches read as `mode` says.
    want_weights, want_history, want_evaluation, _ = _run(
        monkeypatch, "launches", dropout, rows, spe, **fit_kwargs
    )
    assert history == want_history
    assert evaluation == want_evaluation
    for got, want in zip(weights, want_weights):
        np.testing.assert_array_equal(got, want)


def test_large_groups_and_replicas_keep_per_step_launches():
    import tensorflow as tf

    from keras_accel.adapter.backends.tensorflow import fused

    one = fused.GroupRunner(None, "train", None, tf.distribute.get_strategy(), None)
    spec = (tf.TensorSpec([64, 32]), tf.TensorSpec([64, 10]))
    assert one.takes(spec, 32)
    assert not one.takes((tf.TensorSpec([4096, 32, 32, 3]),), 32)  # 1.5 GiB a group.
    assert not one.takes((tf.TensorSpec([None, 32]),), 32)
    assert not one.takes((tf.TensorSpec([64], tf.string),), 32)
