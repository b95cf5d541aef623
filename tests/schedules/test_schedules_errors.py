"""Every construction error: raised early, naming what was received."""

import pytest

from keras_accel.schedules import (
    Constant,
    CosineDecay,
    ExponentialDecay,
    Join,
    LinearDecay,
    PiecewiseConstant,
    Warmup,
    WarmupCosine,
    WarmupLinear,
)

# Backend-generic: the torch run takes these too (tests/conftest.py).
pytestmark = pytest.mark.torch

NAN = float("nan")

# name: (build, fragment or fragments of the message); every message also says "Received:".
ERRORS = {
    # Non-positive or non-numeric learning rates.
    "constant_zero": (lambda: Constant(0.0), "value=0.0"),
    "constant_negative": (lambda: Constant(-1e-3), "greater than 0. Received: value=-0.001"),
    "constant_nan": (lambda: Constant(NAN), "value=nan"),
    "constant_string": (lambda: Constant("1e-3"), "value='1e-3'"),
    "constant_bool": (lambda: Constant(True), "value=True"),
    "piecewise_zero_value": (
        lambda: PiecewiseConstant([1e-3, 0.0], boundaries=[10]),
        "values[1]=0.0",
    ),
    "piecewise_no_values": (lambda: PiecewiseConstant([], boundaries=[]), "values=[]"),
    "exponential_zero_init": (
        lambda: ExponentialDecay(0.0, decay_steps=10, decay_rate=0.5),
        "init_value=0.0",
    ),
    "cosine_negative_end": (lambda: CosineDecay(1.0, end_value=-0.1), "end_value=-0.1"),
    "warmup_cosine_zero_peak": (
        lambda: WarmupCosine(0.0, warmup_steps=1, total_steps=10),
        "peak_value=0.0",
    ),
    "warmup_negative_init": (
        lambda: Warmup(Constant(1.0), warmup_steps=1, init_value=-1.0),
        "init_value=-1.0",
    ),
    # Counts of values and boundaries.
    "piecewise_too_few_values": (
        lambda: PiecewiseConstant([1e-3], boundaries=[10]),
        "one more entry than `boundaries`",
    ),
    "piecewise_too_many_values": (
        lambda: PiecewiseConstant([1e-3, 1e-4, 1e-5], boundaries=[0.5], unit="fraction"),
        "3 entries",
    ),
    "join_too_few_schedules": (lambda: Join([Constant(1.0)], boundaries=[5]), "1 schedules"),
    # Boundaries: increasing, in range for their unit, right type.
    "boundaries_not_increasing": (
        lambda: PiecewiseConstant([1.0, 0.5, 0.1], boundaries=[20, 10]),
        "strictly increasing. Received: boundaries=[20, 10]",
    ),
    "boundaries_repeated": (
        lambda: PiecewiseConstant([1.0, 0.5, 0.1], boundaries=[0.5, 0.5], unit="fraction"),
        "strictly increasing. Received: boundaries=[0.5, 0.5]",
    ),
    "fraction_is_zero": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[0.0], unit="fraction"),
        "boundaries[0]=0.0",
    ),
    "fraction_is_one": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[1.0], unit="fraction"),
        "strictly between 0 and 1",
    ),
    "fraction_is_a_percentage": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[50], unit="fraction"),
        "boundaries[0]=50",
    ),
    "step_boundary_negative": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[-10]),
        "positive whole number of steps. Received: boundaries[0]=-10",
    ),
    "step_boundary_is_a_fraction": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[0.5]),
        "pass unit='fraction'",
    ),
    "epoch_boundary_zero": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[0], unit="epochs"),
        "boundaries[0]=0",
    ),
    "boundaries_not_a_list": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries="10"),
        "boundaries='10'",
    ),
    "unknown_unit": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[10], unit="percent"),
        "['steps', 'epochs', 'fraction']. Received: unit='percent'",
    ),
    "join_unknown_unit": (
        lambda: Join([Constant(1.0), Constant(0.5)], boundaries=[10], unit="epoch"),
        "unit='epoch'",
    ),
    # Step counts.
    "negative_total_steps": (lambda: Constant(1.0, total_steps=-5), "total_steps=-5"),
    "zero_total_steps": (lambda: CosineDecay(1.0, total_steps=0), "total_steps=0"),
    "float_total_steps": (lambda: CosineDecay(1.0, total_steps=100.0), "total_steps=100.0"),
    "zero_steps_per_epoch": (
        lambda: PiecewiseConstant([1.0, 0.5], boundaries=[1], unit="epochs", steps_per_epoch=0),
        "steps_per_epoch=0",
    ),
    "negative_warmup_steps": (
        lambda: WarmupCosine(1.0, warmup_steps=-1, total_steps=10),
        "non-negative whole number of steps. Received: warmup_steps=-1",
    ),
    "warmup_steps_given_a_fraction": (
        lambda: WarmupCosine(1.0, warmup_steps=0.1, total_steps=10),
        "use the `*_fraction` argument",
    ),
    "zero_decay_steps": (
        lambda: ExponentialDecay(1.0, decay_steps=0, decay_rate=0.5),
        "decay_steps=0",
    ),
    # Warmup length.
    "warmup_longer_than_training": (
        lambda: WarmupCosine(1.0, warmup_steps=200, total_steps=100),
        ("shorter than training", "Received: warmup_steps=200, total_steps=100"),
    ),
    "warmup_as_long_as_training": (
        lambda: WarmupLinear(1.0, warmup_steps=100, total_steps=100),
        "warmup_steps=100, total_steps=100",
    ),
    "warmup_longer_than_bound_training": (
        lambda: Warmup(Constant(1.0), warmup_steps=50).with_total_steps(20),
        "warmup_steps=50, total_steps=20",
    ),
    "warmup_fraction_zero": (
        lambda: WarmupCosine(1.0, warmup_fraction=0.0),
        "warmup_fraction=0.0",
    ),
    "warmup_fraction_one": (
        lambda: WarmupCosine(1.0, warmup_fraction=1.0),
        "strictly between 0 and 1, e.g. 0.1 for the first 10% of steps. "
        "Received: warmup_fraction=1.0",
    ),
    "warmup_length_missing": (
        lambda: WarmupCosine(1.0, total_steps=10),
        ("exactly once", "Received: warmup_steps=None, warmup_fraction=None"),
    ),
    "warmup_length_twice": (
        lambda: Warmup(Constant(1.0), warmup_steps=5, warmup_fraction=0.1),
        "warmup_steps=5, warmup_fraction=0.1",
    ),
    # Shapes that make no sense.
    "decay_rate_above_one": (
        lambda: ExponentialDecay(1.0, decay_steps=10, decay_rate=1.5),
        "decay_rate=1.5",
    ),
    "decay_rate_zero": (
        lambda: ExponentialDecay(1.0, decay_steps=10, decay_rate=0.0),
        "decay_rate=0.0",
    ),
    "exponential_floor_above_start": (
        lambda: ExponentialDecay(1.0, decay_steps=10, decay_rate=0.5, end_value=2.0),
        "init_value=1.0, end_value=2.0",
    ),
    "staircase_not_bool": (
        lambda: ExponentialDecay(1.0, decay_steps=10, decay_rate=0.5, staircase="yes"),
        "staircase='yes'",
    ),
    "cosine_ends_above_start": (
        lambda: CosineDecay(1.0, end_value=2.0),
        "init_value=1.0, end_value=2.0",
    ),
    "linear_ends_above_start": (
        lambda: LinearDecay(0.1, end_value=0.2, total_steps=10),
        "init_value=0.1, end_value=0.2",
    ),
    "warmup_cosine_end_above_peak": (
        lambda: WarmupCosine(1.0, warmup_steps=1, end_value=2.0),
        "peak_value=1.0, end_value=2.0",
    ),
    "warmup_cosine_init_above_peak": (
        lambda: WarmupCosine(1.0, warmup_steps=1, init_value=2.0),
        "init_value=2.0, peak_value=1.0",
    ),
    # Nested schedules.
    "warmup_of_a_float": (lambda: Warmup(1e-3, warmup_steps=10), "Wrap a fixed rate"),
    "join_of_a_function": (
        lambda: Join([Constant(1.0), lambda step: 0.1], boundaries=[10]),
        "schedules[1]=<function",
    ),
    "join_not_a_list": (lambda: Join(Constant(1.0), boundaries=[]), "schedules=Constant("),
    "join_last_piece_has_no_steps": (
        lambda: Join([Constant(1.0), CosineDecay(1.0)], boundaries=[10], total_steps=10),
        ("leaves no steps for schedules[1]", "total_steps=10"),
    ),
}


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error(name):
    build, fragment = ERRORS[name]
    with pytest.raises(ValueError, match="Received:") as info:
        build()
    fragments = (fragment,) if isinstance(fragment, str) else fragment
    for expected in fragments:
        assert expected in str(info.value)


def test_with_total_steps_checks_its_arguments():
    schedule = CosineDecay(1.0)
    with pytest.raises(ValueError, match="Received: total_steps=0"):
        schedule.with_total_steps(0)
    with pytest.raises(ValueError, match="Received: total_steps=None"):
        schedule.with_total_steps(None)
    with pytest.raises(ValueError, match="Received: steps_per_epoch=-1"):
        schedule.with_total_steps(10, steps_per_epoch=-1)


def test_unbound_call_names_the_missing_piece():
    schedule = Join([Constant(1.0), WarmupCosine(1.0, warmup_steps=2)], boundaries=[5])
    with pytest.raises(ValueError, match=r"the WarmupCosine from step 5 needs it: .*total_steps"):
        schedule(0)
    schedule = Warmup(PiecewiseConstant([1.0, 0.1], boundaries=[1], unit="epochs"), warmup_steps=1)
    with pytest.raises(ValueError, match="PiecewiseConstant after the warmup needs it"):
        schedule(0)
