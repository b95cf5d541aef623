"""The registry of the keras-io ports: `@example("area/name")` on a function that builds the
example's model (compiled as published) and synthetic data, and returns a `Port`.

Each port function is called twice per test, after the same `keras.utils.set_random_seed`:
once in the Accelerator's scope, once outside it for plain Keras's twin, so it must build
everything afresh (model, data, callbacks) and draw its data from its own NumPy generator.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

BACKENDS = ("jax", "tensorflow", "torch")
EXAMPLES: dict[str, "Example"] = {}


@dataclasses.dataclass
class Port:
    """A built, compiled model and the keyword arguments of its calls.

    `fit` holds the published `fit` call's arguments, shrunk (`x`, `y`, `batch_size`,
    `epochs`, `validation_data`, `class_weight`, callbacks ...; the test adds
    `shuffle=False` and `verbose=0`); `evaluate` and `predict` those of a later
    `evaluate`/`predict` on held-out rows, or None where the example has none that works
    (a model without targets)."""

    model: Any
    fit: dict
    evaluate: dict | None = None
    predict: dict | None = None


@dataclasses.dataclass(frozen=True)
class Example:
    name: str  # keras-io's examples/<area>/<name>.py
    port: Callable[[], Port]
    backends: tuple = BACKENDS  # TensorFlow only where the published code is (tf.GradientTape)


def example(name: str, backends: tuple = BACKENDS):
    def register(function):
        assert name not in EXAMPLES, name
        EXAMPLES[name] = Example(name, function, backends)
        return function

    return register


def rng(name: str) -> np.random.Generator:
    """The example's own generator, seeded from its name: the same data in both calls."""
    return np.random.default_rng(sum(name.encode()))
