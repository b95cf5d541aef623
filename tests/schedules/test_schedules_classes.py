"""Each schedule class against explicit arrays, eagerly and compiled, and the training length."""

import numpy as np
import pytest

from keras_accel.schedules import (
    Constant,
    CosineDecay,
    ExponentialDecay,
    Join,
    LinearDecay,
    PiecewiseConstant,
    Schedule,
    Warmup,
    WarmupCosine,
    WarmupLinear,
)

COS_4 = [1.0, 0.85355339, 0.5, 0.14644661]  # half a cosine from 1 to 0 over 4 steps

CASES = {
    "constant": (Constant(0.1), [0.1] * 4),
    "piecewise_steps": (PiecewiseConstant([1.0, 0.5], boundaries=[3]), [1, 1, 1, 0.5, 0.5]),
    # The seed's example: divide the rate by 10 half-way through (10 steps of training).
    "piecewise_fraction": (
        PiecewiseConstant([1e-3, 1e-4], boundaries=[0.5], unit="fraction", total_steps=10),
        [1e-3] * 5 + [1e-4] * 7,
    ),
    "piecewise_epochs": (
        PiecewiseConstant([1.0, 0.1, 0.01], boundaries=[1, 2.5], unit="epochs", steps_per_epoch=4),
        [1.0] * 4 + [0.1] * 6 + [0.01] * 2,
    ),
    "exponential": (
        ExponentialDecay(1.0, decay_steps=2, decay_rate=0.5),
        [1.0, 0.70710678, 0.5, 0.35355339, 0.25],
    ),
    "exponential_staircase_floor": (
        ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5, staircase=True, end_value=0.2),
        [1.0, 0.5, 0.25, 0.2, 0.2],
    ),
    "cosine": (CosineDecay(1.0, total_steps=4), [*COS_4, 0.0, 0.0]),
    "linear": (LinearDecay(1.0, end_value=0.2, total_steps=4), [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]),
    "warmup_cosine": (
        WarmupCosine(1.0, warmup_steps=2, total_steps=6),
        [0.0, 0.5, *COS_4, 0.0, 0.0],
    ),
    "warmup_cosine_init_end": (
        WarmupCosine(1.0, warmup_steps=2, init_value=0.1, end_value=0.1, total_steps=6),
        [0.1, 0.55, 1.0, 0.86819805, 0.55, 0.23180195, 0.1, 0.1],
    ),
    "warmup_linear_fraction": (
        WarmupLinear(1.0, warmup_fraction=0.25, total_steps=8),
        [0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0],
    ),
    "warmup_zero_steps": (WarmupCosine(1.0, warmup_steps=0, total_steps=4), [*COS_4, 0.0]),
    "warmup_exponential": (
        Warmup(ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5), warmup_steps=2),
        [0.0, 0.5, 1.0, 0.5, 0.25],
    ),
    "warmup_binds_its_schedule": (
        Warmup(CosineDecay(1.0), warmup_fraction=0.5, total_steps=4),
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0],
    ),
    "warmup_keeps_a_bound_schedule": (
        Warmup(CosineDecay(1.0, total_steps=2), warmup_steps=2, total_steps=100),
        [0.0, 0.5, 1.0, 0.5, 0.0, 0.0],
    ),
    "join_steps": (
        Join([Constant(1.0), LinearDecay(1.0)], boundaries=[3], total_steps=7),
        [1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0],
    ),
    # The middle piece is bound to its 4 steps without knowing the length of training.
    "join_middle_piece": (
        Join([Constant(1.0), CosineDecay(1.0), Constant(0.5)], boundaries=[2, 6]),
        [1.0, 1.0, *COS_4, 0.5, 0.5],
    ),
    # Fractions inside a piece are fractions of that piece: 0.5 of steps 2..9 is step 6.
    "join_fraction": (
        Join(
            [Constant(1.0), PiecewiseConstant([1.0, 0.1], boundaries=[0.5], unit="fraction")],
            boundaries=[0.2],
            unit="fraction",
            total_steps=10,
        ),
        [1.0] * 6 + [0.1] * 4,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_values(evaluate, name):
    schedule, expected = CASES[name]
    out = evaluate(schedule, np.arange(len(expected)))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(CASES))
def test_scalar_step(name):
    schedule, expected = CASES[name]
    assert float(schedule(2)) == pytest.approx(expected[2], rel=1e-5, abs=1e-7)


@pytest.mark.torch
def test_fraction_boundaries_round_to_the_nearest_step():
    # 0.29 * 100 is 28.999... in floating point; the boundary must still be step 29.
    schedule = PiecewiseConstant([1.0, 0.5], boundaries=[0.29], unit="fraction", total_steps=100)
    np.testing.assert_allclose(schedule(np.array([28, 29])), [1.0, 0.5])


@pytest.mark.torch
def test_warmup_fraction_leaves_one_step_after_the_warmup():
    # 0.9 of 2 steps rounds to 2: the warmup is cut to 1 step so the decay still runs.
    schedule = WarmupLinear(1.0, warmup_fraction=0.9, total_steps=2)
    np.testing.assert_allclose(schedule(np.arange(3)), [0.0, 1.0, 0.0])


@pytest.mark.torch
def test_join_drops_pieces_a_short_run_rounds_away():
    # 0.3 and 0.4 of 2 steps both round to step 1: the cosine piece never runs.
    schedule = Join(
        [Constant(1.0), CosineDecay(1.0), Constant(0.5)], boundaries=[0.3, 0.4], unit="fraction"
    ).with_total_steps(2)
    assert not schedule.needs_total_steps
    np.testing.assert_allclose(schedule(np.arange(3)), [1.0, 0.5, 0.5])


@pytest.mark.torch
def test_join_without_total_steps_accepts_a_last_piece_that_needs_none():
    schedule = Join([CosineDecay(1.0), Constant(0.5)], boundaries=[4])
    assert not schedule.needs_total_steps
    np.testing.assert_allclose(schedule(np.arange(6)), [*COS_4, 0.5, 0.5], rtol=1e-5, atol=1e-7)


@pytest.mark.torch
def test_join_last_boundary_past_the_end_is_fine_when_the_last_piece_needs_no_length():
    schedule = Join([Constant(1.0), Constant(0.5)], boundaries=[50], total_steps=10)
    assert float(schedule(9)) == pytest.approx(1.0)


# -- training length ------------------------------------------------------------------------


def unbound_schedules():
    return {
        "fraction": PiecewiseConstant([1.0, 0.1], boundaries=[0.5], unit="fraction"),
        "cosine": CosineDecay(1.0),
        "warmup_cosine": WarmupCosine(1.0, warmup_steps=2),
        "warmup_fraction": Warmup(Constant(1.0), warmup_fraction=0.1),
        "warmup_of_unbound": Warmup(LinearDecay(1.0), warmup_steps=2),
        "join_last_piece": Join([Constant(1.0), CosineDecay(1.0)], boundaries=[2]),
        "join_fraction": Join([Constant(1.0), Constant(0.5)], boundaries=[0.5], unit="fraction"),
    }


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(unbound_schedules()))
def test_unbound_schedule_says_what_is_missing(name):
    schedule = unbound_schedules()[name]
    assert schedule.needs_total_steps
    assert schedule.total_steps is None
    with pytest.raises(
        ValueError, match=r"cannot be evaluated yet: .*total_steps.*with_total_steps"
    ):
        schedule(0)


@pytest.mark.parametrize("name", sorted(unbound_schedules()))
def test_with_total_steps_returns_a_bound_copy(name):
    schedule = unbound_schedules()[name]
    bound = schedule.with_total_steps(20)
    assert bound is not schedule and type(bound) is type(schedule)
    assert bound.total_steps == 20 and not bound.needs_total_steps
    assert schedule.needs_total_steps  # the original is untouched
    assert np.all(np.isfinite(bound(np.arange(25))))
    assert bound.get_config()["total_steps"] == 20


@pytest.mark.torch
def test_epoch_boundaries_need_steps_per_epoch():
    schedule = PiecewiseConstant([1.0, 0.1], boundaries=[2], unit="epochs")
    assert schedule.needs_total_steps
    with pytest.raises(ValueError, match="in epochs and `steps_per_epoch` is not set"):
        schedule.with_total_steps(100)(0)
    bound = schedule.with_total_steps(100, steps_per_epoch=10)
    assert bound.steps_per_epoch == 10 and not bound.needs_total_steps
    np.testing.assert_allclose(bound(np.array([19, 20])), [1.0, 0.1], rtol=1e-6)


@pytest.mark.torch
def test_join_passes_steps_per_epoch_to_its_pieces():
    piece = PiecewiseConstant([1.0, 0.1], boundaries=[1], unit="epochs")
    schedule = Join([Constant(2.0), piece], boundaries=[1], unit="epochs")
    bound = schedule.with_total_steps(40, steps_per_epoch=10)
    np.testing.assert_allclose(bound(np.array([9, 10, 19, 20])), [2.0, 1.0, 1.0, 0.1])


@pytest.mark.torch
def test_schedules_that_need_no_length_accept_one():
    schedule = ExponentialDecay(1.0, decay_steps=1, decay_rate=0.5)
    assert not schedule.needs_total_steps
    bound = schedule.with_total_steps(10)
    assert bound.total_steps == 10
    assert float(bound(1)) == pytest.approx(0.5)


@pytest.mark.torch
def test_every_schedule_is_a_keras_schedule():
    import keras

    for schedule, _ in CASES.values():
        assert isinstance(schedule, Schedule)
        assert isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule)


@pytest.mark.torch
def test_repr_shows_the_arguments():
    assert repr(WarmupCosine(1e-3, warmup_steps=10, total_steps=100)) == (
        "WarmupCosine(peak_value=0.001, warmup_steps=10, warmup_fraction=None, "
        "init_value=0.0, end_value=0.0, total_steps=100)"
    )
