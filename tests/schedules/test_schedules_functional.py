"""The pure `step -> value` functions, against explicit arrays, eagerly and compiled."""

import numpy as np
import pytest

from keras_accel.schedules import functional

STEPS = np.arange(6)


def test_constant(evaluate):
    out = evaluate(lambda s: functional.constant(s, value=0.1), STEPS[:4])
    np.testing.assert_allclose(out, [0.1, 0.1, 0.1, 0.1], rtol=1e-6)
    assert out.dtype == np.float32


def test_piecewise_constant_changes_at_the_boundary(evaluate):
    out = evaluate(
        lambda s: functional.piecewise_constant(s, values=[1.0, 0.1, 0.01], boundaries=[2, 4]),
        STEPS,
    )
    np.testing.assert_allclose(out, [1.0, 1.0, 0.1, 0.1, 0.01, 0.01], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [1.0, 0.70710678, 0.5, 0.35355339, 0.25]),
        ({"staircase": True}, [1.0, 1.0, 0.5, 0.5, 0.25]),
        ({"end_value": 0.3}, [1.0, 0.70710678, 0.5, 0.35355339, 0.3]),
    ],
)
def test_exponential_decay(evaluate, kwargs, expected):
    out = evaluate(
        lambda s: functional.exponential_decay(
            s, init_value=1.0, decay_steps=2, decay_rate=0.5, **kwargs
        ),
        STEPS[:5],
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_linear_decay_is_flat_after_the_end(evaluate):
    out = evaluate(
        lambda s: functional.linear_decay(s, init_value=1.0, end_value=0.0, decay_steps=4), STEPS
    )
    np.testing.assert_allclose(out, [1.0, 0.75, 0.5, 0.25, 0.0, 0.0], atol=1e-7)


@pytest.mark.parametrize(
    ("end_value", "expected"),
    [
        (0.0, [1.0, 0.85355339, 0.5, 0.14644661, 0.0, 0.0]),
        (0.2, [1.0, 0.88284271, 0.6, 0.31715729, 0.2, 0.2]),
    ],
)
def test_cosine_decay(evaluate, end_value, expected):
    out = evaluate(
        lambda s: functional.cosine_decay(s, init_value=1.0, end_value=end_value, decay_steps=4),
        STEPS,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6, atol=1e-7)


def test_linear_warmup(evaluate):
    out = evaluate(
        lambda s: functional.linear_warmup(s, init_value=0.0, peak_value=1.0, warmup_steps=4),
        STEPS,
    )
    np.testing.assert_allclose(out, [0.0, 0.25, 0.5, 0.75, 1.0, 1.0], atol=1e-7)


def test_join_restarts_each_schedule_at_its_boundary(evaluate):
    def decay(s):
        return functional.linear_decay(s, init_value=1.0, end_value=0.0, decay_steps=2)

    out = evaluate(
        lambda s: functional.join(
            s, schedules=[lambda s: functional.constant(s, value=1.0), decay], boundaries=[3]
        ),
        np.arange(7),
    )
    np.testing.assert_allclose(out, [1.0, 1.0, 1.0, 1.0, 0.5, 0.0, 0.0], atol=1e-7)


@pytest.mark.torch
def test_scalar_step_gives_scalar():
    out = functional.cosine_decay(2, init_value=1.0, end_value=0.0, decay_steps=4)
    assert tuple(out.shape) == ()
    assert float(out) == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("fn", "kwargs", "name"),
    [
        (functional.linear_decay, {"init_value": 1.0, "end_value": 0.0}, "decay_steps"),
        (functional.cosine_decay, {"init_value": 1.0, "end_value": 0.0}, "decay_steps"),
        (functional.linear_warmup, {"init_value": 0.0, "peak_value": 1.0}, "warmup_steps"),
    ],
)
@pytest.mark.torch
def test_zero_length_is_refused(fn, kwargs, name):
    with pytest.raises(ValueError, match=f"Received: {name}=0"):
        fn(1, **{name: 0}, **kwargs)


@pytest.mark.torch
def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="one more entry"):
        functional.piecewise_constant(0, values=[1.0], boundaries=[2])
    with pytest.raises(ValueError, match="one more entry"):
        functional.join(0, schedules=[lambda s: s], boundaries=[2])
