"""Targets with one loss value per time step (token tagging, sequence regression), on
uneven data: the padded last batch trains and evaluates as plain one-device Keras does on
the real rows. The padding weights take the rank of each output's loss, `(rows, 1)` for
`(rows, steps)`, and fold into a Keras mask (`Embedding(mask_zero=True)`), whose mean over
unmasked steps is counted over every replica. Before, a row's weight `(rows,)` met a loss
`(rows, steps)` and every backend crashed in `fit` and `evaluate`.

21 rows in batches of 8 on the suite's devices (a last batch of 5 rows, padded), against
plain Keras on one device (`shuffle=False` both)."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.conftest import BACKEND, NUM_DEVICES
from tests.helpers import FEW_REPLICAS, assert_weights_close, weights_of

pytestmark = pytest.mark.torch

# TensorFlow traces every step once per replica: two take every cross-replica path
# (`FEW_REPLICAS`); the subject here is the weighting of sequence losses, not the count.
DEVICES = FEW_REPLICAS if BACKEND == "tensorflow" else NUM_DEVICES
ROWS, BATCH, STEPS, VOCAB, CLASSES = 21, 8, 6, 12, 4


@pytest.fixture(scope="module")
def acc():
    return Accelerator(devices=DEVICES)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCAB, (ROWS, STEPS))
    lengths = rng.integers(2, STEPS + 1, ROWS)
    tokens[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0  # Padded sequences, mask_zero.
    tags = rng.integers(0, CLASSES, (ROWS, STEPS))
    weights = rng.uniform(0.5, 2.0, (ROWS, STEPS)).astype("float32")
    return tokens, tags, weights


def _tagger(mask_zero):
    keras.utils.set_random_seed(3)
    tokens = keras.Input((STEPS,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero)(tokens)
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    model = keras.Model(tokens, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        keras.optimizers.SGD(0.5),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        weighted_metrics=["accuracy"],
    )
    return model


def _both(acc, build, fit_kwargs):
    """(Accelerator, plain one-device Keras): fit logs, evaluate's dict, weights, model."""
    evaluate_kwargs = dict(fit_kwargs)
    with acc.scope():
        ours = build()
    history = acc.fit(ours, **fit_kwargs, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    ours_eval = acc.evaluate(ours, **evaluate_kwargs, batch_size=BATCH, verbose=0, return_dict=True)
    plain = build()
    plain_history = plain.fit(**fit_kwargs, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    plain_eval = plain.evaluate(**evaluate_kwargs, batch_size=BATCH, verbose=0, return_dict=True)
    return (history.history, ours_eval, weights_of(ours), ours), (
        plain_history.history,
        plain_eval,
        weights_of(plain),
        plain,
    )


def _assert_same(ours, plain, apart=()):
    """Equal logs, evaluation and weights, but for the logs named in `apart`."""
    (history, evaluated, weights, _), (plain_history, plain_evaluated, plain_weights, _) = (
        ours,
        plain,
    )
    assert sorted(history) == sorted(plain_history)
    for name in set(plain_history) - set(apart):
        np.testing.assert_allclose(history[name], plain_history[name], rtol=1e-5, err_msg=name)
    for name in set(plain_evaluated) - set(apart):
        np.testing.assert_allclose(evaluated[name], plain_evaluated[name], rtol=1e-5, err_msg=name)
    assert_weights_close(weights, plain_weights)


@pytest.mark.parametrize("mask_zero", [False, True], ids=["unmasked", "mask_zero"])
@pytest.mark.parametrize("temporal_weights", [False, True], ids=["no_weights", "step_weights"])
def test_a_loss_per_time_step_trains_and_evaluates_as_one_device(acc, mask_zero, temporal_weights):
    tokens, tags, weights = _data()
    data = {"x": tokens, "y": tags}
    if temporal_weights:
        data["sample_weight"] = weights
    ours, plain = _both(acc, lambda: _tagger(mask_zero), data)
    if not (mask_zero and temporal_weights and keras.backend.backend() == "torch"):
        _assert_same(ours, plain)
        return
    # Keras on torch multiplies a masked loss's mask into the batch's weights in place
    # (`sample_weight *= mask` in keras/src/losses/loss.py's `apply_mask`), so plain Keras's
    # `weighted_metrics` then read weights scaled by each batch's unmasked fraction. Ours
    # read the user's weights: everything else equals plain Keras, and the weighted
    # accuracy equals the one computed here from the predictions.
    _assert_same(ours, plain, apart={"weighted_accuracy"})
    model = ours[3]
    guess = np.argmax(keras.ops.convert_to_numpy(model.predict(tokens, verbose=0)), -1)
    counted = weights * (tokens != 0)
    expected = np.sum((guess == tags) * counted) / np.sum(counted)
    np.testing.assert_allclose(ours[1]["weighted_accuracy"], expected, rtol=1e-5)


def _two_outputs():
    """A sequence output with a loss per step beside a per-row output: the padding
    weights are one per output, of each loss's rank."""
    keras.utils.set_random_seed(4)
    tokens = keras.Input((STEPS, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(tokens)
    steps = keras.layers.Dense(2, name="steps")(hidden)
    whole = keras.layers.Dense(CLASSES, name="whole")(keras.layers.Flatten()(hidden))
    model = keras.Model(tokens, {"steps": steps, "whole": whole})
    model.compile(
        keras.optimizers.SGD(0.1),
        {
            "steps": keras.losses.MeanSquaredError(),
            "whole": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        },
        metrics={"steps": ["mae"], "whole": ["accuracy"]},
    )
    return model


def test_dense_sequence_targets_beside_a_per_row_output(acc):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, STEPS, 3)).astype("float32")
    y = {
        "steps": rng.normal(size=(ROWS, STEPS, 2)).astype("float32"),
        "whole": rng.integers(0, CLASSES, ROWS),
    }
    ours, plain = _both(acc, _two_outputs, {"x": x, "y": y})
    if keras.backend.backend() != "tensorflow":
        _assert_same(ours, plain)
        return
    # Plain Keras on TensorFlow averages each output's own loss over the batches unweighted
    # (its tracker's weight, the batch's static row count, is unknown in the traced step),
    # so those logs do not add up to its `loss`; ours weigh each batch by its rows, as
    # Keras does on JAX and torch, and add up.
    per_output = {"steps_loss", "whole_loss"}
    _assert_same(ours, plain, apart=per_output)
    history, evaluated = ours[0], ours[1]
    np.testing.assert_allclose(
        np.add(history["steps_loss"], history["whole_loss"]), history["loss"], rtol=1e-5
    )
    # After `fit`, Keras's per-output trackers are built, so they are among the model's
    # own metrics too: `evaluate` weighted its padded last batch twice there
    # (real rows ** 2 / static), and its per-output losses missed its `loss`.
    np.testing.assert_allclose(
        evaluated["steps_loss"] + evaluated["whole_loss"], evaluated["loss"], rtol=1e-5
    )


SEQUENCES_SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_sequences.py")


@pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch backend's processes")
def test_two_torch_processes_equal_one_on_masked_sequence_targets(tmp_path):
    """A tagger under `mask_zero`, with and without per-step weights, on 21 rows in batches
    of 8 (tests/adapter/_torch_sequences.py), and a tagger whose loss is a sum: 2 gloo
    processes, whose unmasked steps differ in every batch, end where one process ends, and
    agree bit for bit."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)

    def run(*command):
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    run(sys.executable, SEQUENCES_SCRIPT, str(tmp_path / "one"))
    launch = (sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2")
    run(*launch, SEQUENCES_SCRIPT, str(tmp_path / "two"))
    one, first, second = (
        dict(np.load(tmp_path / f"{name}.npz")) for name in ("one-0", "two-0", "two-1")
    )
    assert sorted(one) == sorted(first) == sorted(second)
    assert any(key.startswith("weighted/evaluate/") for key in one)
    assert "sum/fit/loss" in one and "divided/fit/loss" in one
    for key in one:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], one[key], rtol=1e-5, atol=1e-6, err_msg=key)
