"""torch: Keras's train and test steps compiled as one program each
(`keras_accel.adapter.backends.torch.compiled`), with plain eager Keras's numbers.

Each case trains on uneven data (a padded last batch) and compares against plain
`model.fit`/`evaluate` on one device, eagerly, `shuffle=False` both. A compilation costs
seconds here: few models, each compiled once."""

import warnings

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import assert_weights_close, timed_ways

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="torch's compiled steps"),
]

ROWS, BATCH = 37, 8


@pytest.fixture
def compiled():
    from keras_accel.adapter.backends.torch import compiled as torch_compiled

    return torch_compiled


class RunningMax(keras.metrics.Metric):
    """A user's metric whose state is not a sum."""

    def __init__(self, name="running_max", **kwargs):
        super().__init__(name=name, **kwargs)
        self.value = self.add_variable((), initializer="zeros", name="value")

    def update_state(self, y_true, y_pred, sample_weight=None):
        # The largest batch mean so far (`ops.max` on torch reads `result.values`, which
        # torch.compile cannot trace: such a step runs eagerly), weighted: a padded batch's
        # mean is its real rows' (unweighted, the padding probe finds it and the last batch
        # runs unpadded, as a step of its own shape).
        first = y_pred[:, 0]
        if sample_weight is None:
            mean = keras.ops.mean(first)
        else:
            weights = keras.ops.reshape(keras.ops.cast(sample_weight, first.dtype), (-1,))
            mean = keras.ops.sum(first * weights) / keras.ops.sum(weights)
        self.value.assign(keras.ops.maximum(self.value, mean))

    def result(self):
        return self.value


class Unused(keras.layers.Layer):
    """A trainable weight the loss never reaches: Keras's eager step gives it no gradient,
    and Adam must not move it."""

    def build(self, input_shape):
        self.unused = self.add_weight((3,), initializer="ones", name="unused")

    def call(self, x):
        return x


def _model(sequence=False):
    keras.utils.set_random_seed(3)
    if sequence:
        inputs = keras.Input((6,), dtype="int32")
        h = keras.layers.Embedding(12, 8, mask_zero=True)(inputs)
        outputs = keras.layers.Dense(4, activation="softmax")(h)
    else:
        inputs = keras.Input((5,))
        h = keras.layers.Dense(16, activation="relu")(inputs)
        h = keras.layers.BatchNormalization()(h)
        h = Unused()(h)
        outputs = keras.layers.Dense(3, activation="softmax")(h)
    return keras.Model(inputs, outputs)


def _compile(model, sequence=False, jit_compile=False):
    if sequence:
        model.compile("adam", "sparse_categorical_crossentropy", jit_compile=jit_compile)
    else:
        model.compile(
            "adam",
            "categorical_crossentropy",
            metrics=["accuracy", RunningMax()],
            weighted_metrics=["mae"],
            jit_compile=jit_compile,
        )


def _data(sequence=False):
    rng = np.random.default_rng(0)
    if sequence:
        x = rng.integers(1, 12, (ROWS, 6))
        lengths = rng.integers(2, 7, ROWS)
        x[np.arange(6)[None, :] >= lengths[:, None]] = 0
        return x, rng.integers(0, 4, (ROWS, 6)), None
    x = rng.normal(size=(ROWS, 5)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 3, ROWS), 3)
    return x, y, rng.uniform(0.5, 2.0, ROWS).astype("float32")


def _pair(acc, sequence=False, jit_compile=False):
    with acc.scope():
        ours = _model(sequence)
        _compile(ours, sequence, jit_compile)
    plain = _model(sequence)
    _compile(plain, sequence)
    return ours, plain


def _fit_both(acc, ours, plain, x, y, w, epochs=2):
    kwargs = dict(batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not be compiled.*")
        history = acc.fit(ours, x, y, sample_weight=w, **kwargs)
        logs = acc.evaluate(ours, x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    expected = plain.fit(x, y, sample_weight=w, **kwargs)
    plain_logs = plain.evaluate(x, y, sample_weight=w, batch_size=BATCH, verbose=0)
    return history.history, expected.history, logs, plain_logs


def _count_ways(monkeypatch, compiled):
    """How many steps of each kind ran each way from here on."""
    counts = {}
    run, eager = compiled.CompiledStep._compiled, compiled.CompiledStep._eager

    def spy(way, function):
        def counted(self, model, data):
            key = (self.kind, way)
            counts[key] = counts.get(key, 0) + 1
            return function(self, model, data)

        return counted

    monkeypatch.setattr(compiled.CompiledStep, "_compiled", spy("compiled", run))
    monkeypatch.setattr(compiled.CompiledStep, "_eager", spy("eager", eager))
    return counts


def test_auto_compiles_where_measured_faster_with_plain_keras_s_numbers(compiled, monkeypatch):
    from keras_accel.adapter import choice

    timed_ways(monkeypatch, plain=2e-3, compiled=2e-4)
    monkeypatch.setitem(choice.TRIAL_UNITS, "torch", 2)  # A short trial on a short fit.
    acc = Accelerator(seed=0)
    ours, plain = _pair(acc)
    x, y, w = _data()
    counts = _count_ways(monkeypatch, compiled)
    ours_h, plain_h, logs, plain_logs = _fit_both(acc, ours, plain, x, y, w, epochs=3)
    # Both kinds compiled: training after its trial (a step that builds, one untimed and
    # one timed eager step, the compilation, then 2 of each way), and the evaluation's.
    assert set(compiled._PROGRAMS[ours]) == {"train", "test"}
    assert counts[("train", "compiled")] == 15 - 1 - 2 - 2
    for name in plain_h:
        np.testing.assert_allclose(ours_h[name], plain_h[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(logs, plain_logs, rtol=1e-5)
    assert_weights_close(ours.get_weights(), plain.get_weights())
    unused = [v for v in ours.trainable_variables if "unused" in v.path]
    np.testing.assert_array_equal(keras.ops.convert_to_numpy(unused[0].value), np.ones(3))


def test_a_compiled_step_measured_slower_is_left_for_the_eager_one(compiled, monkeypatch):
    from keras_accel.adapter import choice

    timed_ways(monkeypatch, plain=2e-4, compiled=2e-3)
    monkeypatch.setitem(choice.TRIAL_UNITS, "torch", 2)
    acc = Accelerator(seed=0)
    ours, _ = _pair(acc)
    x, y, w = _data()
    counts = _count_ways(monkeypatch, compiled)
    acc.fit(ours, x, y, sample_weight=w, batch_size=BATCH, epochs=4, verbose=0)
    # The trial's compilation and one timed compiled step (10 times as slow: given up at
    # once), every other step eager.
    assert counts[("train", "compiled")] == 2 and counts[("train", "eager")] == 20 - 2


def test_jit_compile_compiles_a_masked_sequence_tagger_from_its_second_step(compiled):
    acc = Accelerator(seed=0)
    ours, plain = _pair(acc, sequence=True, jit_compile=True)
    x, y, w = _data(sequence=True)
    ours_h, plain_h, logs, plain_logs = _fit_both(acc, ours, plain, x, y, w)
    assert set(compiled._PROGRAMS[ours]) == {"train", "test"}
    np.testing.assert_allclose(ours_h["loss"], plain_h["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs, plain_logs, rtol=1e-5)
    assert_weights_close(ours.get_weights(), plain.get_weights())


class Penalty(keras.layers.Layer):
    """An activity penalty a layer adds with `add_loss` (keras-io's endpoint layer's way)."""

    def call(self, inputs):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


def test_a_loss_a_layer_adds_counts_in_the_compiled_step(compiled):
    # A stateless call drops what `add_loss` adds unless its scope collects it: the loss
    # was the compiled loss alone, silently (the weights 3e-3 off after 12 steps).
    acc = Accelerator(seed=0)

    def model():
        keras.utils.set_random_seed(1)
        m = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(8, activation="tanh"),
                Penalty(),
                keras.layers.Dense(3),
            ]
        )
        m.compile("sgd", "categorical_crossentropy", jit_compile=True)
        return m

    with acc.scope():
        ours = model()
    plain = model()
    plain.jit_compile = False
    x, y, _ = _data()
    x, y = x[:32], y[:32]  # Whole batches: one compiled shape.
    ours_h, plain_h, logs, plain_logs = _fit_both(acc, ours, plain, x, y, None)
    assert set(compiled._PROGRAMS[ours]) == {"train", "test"}
    np.testing.assert_allclose(ours_h["loss"], plain_h["loss"], rtol=1e-5)
    np.testing.assert_allclose(logs, plain_logs, rtol=1e-5)
    assert_weights_close(ours.get_weights(), plain.get_weights())


def test_a_step_torch_cannot_compile_runs_eagerly_with_one_note(compiled):
    # Keras's torch Dropout seeds a torch.Generator from a tensor: not traceable.
    acc = Accelerator(seed=0)

    def model():
        keras.utils.set_random_seed(5)
        m = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dropout(0.3, seed=1), keras.layers.Dense(3)]
        )
        m.compile("sgd", "mse", jit_compile=True)
        return m

    with acc.scope():
        ours = model()
    plain = model()
    x, y = np.ones((ROWS, 5), "float32"), np.ones((ROWS, 3), "float32")
    with pytest.warns(UserWarning, match="could not be compiled by torch.compile") as notes:
        acc.fit(ours, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert sum("could not be compiled" in str(n.message) for n in notes) == 1
    plain.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), plain.get_weights())


def test_keras_accel_jit_compile_0_never_compiles(compiled, monkeypatch):
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_AFTER", "0")
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE", "0")
    acc = Accelerator(seed=0)
    ours, _ = _pair(acc, jit_compile=True)
    x, y, w = _data()
    acc.fit(ours, x, y, sample_weight=w, batch_size=BATCH, epochs=1, verbose=0)
    assert ours not in compiled._PROGRAMS


def test_the_gradients_keras_s_step_applies_are_recorded_and_the_optimizer_left_as_it_was(
    compiled,
):
    """Which weights get no gradient is read from what Keras's eager step hands its
    optimizer (Keras 3.16's step under `jit_compile=True` leaves every `.grad` None)."""
    import torch

    optimizer = keras.optimizers.SGD(0.5)
    a, b = keras.Variable(np.ones(2, "float32")), keras.Variable(np.ones(1, "float32"))
    optimizer.build([a, b])
    with compiled._gradients_applied(optimizer) as applied:
        optimizer.apply((torch.full((2,), 2.0), None), [a, b])
    assert "apply" not in vars(optimizer)  # The class's own method again.
    assert len(applied) == 1 and applied[0][1] == [a, b] and applied[0][0][1] is None
    np.testing.assert_allclose(keras.ops.convert_to_numpy(a.value), [0.0, 0.0])  # It ran.
    np.testing.assert_allclose(keras.ops.convert_to_numpy(b.value), [1.0])
    with compiled._gradients_applied(None) as nothing:
        pass
    assert nothing == []


def test_weights_without_a_gradient_in_every_apply_of_the_step(compiled):
    """A step may apply gradients in several calls (each with some weights): a weight has
    one if any call gave it one. Without the calls' variables, `.grad` decides, and where it
    is all None (Keras 3.16's `torch.autograd.grad`) every weight is taken to have one."""
    a, b, c = (keras.Variable(np.ones(2, "float32")) for _ in range(3))
    one = np.ones(2, "float32")
    applied = [([one, None], [a, b]), ([None], [c])]
    assert compiled._no_gradient([a, b, c], applied) == (False, True, True)
    applied.append(([one], [b]))
    assert compiled._no_gradient([a, b, c], applied) == (False, False, True)
    assert compiled._no_gradient([a, b, c], [([one, one, one], None)]) == (False, False, False)
    assert compiled._no_gradient([a, b, c], []) == (False, False, False)
