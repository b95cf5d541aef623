"""Keras's process-wide state: its config module (where keras.json lives) and its global
seeding (`keras.utils.set_random_seed`'s module, `keras.random.SeedGenerator`'s, and the
global-state store `keras.utils.clear_session` empties)."""

from __future__ import annotations

from keras_accel.utils.keras_internals.lookup import (
    Internal,
    first,
    holder,
    module_at,
    module_of,
)

_CONFIG = first(module_of("keras.config.backend"), module_at("keras.src.backend.config"))
_GLOBAL_STATE = first(
    module_of("keras.utils.clear_session"), module_at("keras.src.backend.common.global_state")
)
_RNG_UTILS = first(module_of("keras.utils.set_random_seed"), module_at("keras.src.utils.rng_utils"))
_SEED_GENERATOR = first(
    module_of("keras.random.SeedGenerator"), module_at("keras.src.random.seed_generator")
)

KERAS_HOME = Internal("keras's config module", "keras_home", "where keras.json lives", _CONFIG)
SET_GLOBAL_ATTRIBUTE = Internal(
    "keras's global state", "set_global_attribute", "seeding", _GLOBAL_STATE
)
GLOBAL_RANDOM_SEED = Internal(
    "keras.utils.set_random_seed's module", "GLOBAL_RANDOM_SEED", "seeding", _RNG_UTILS
)
GLOBAL_SEED_GENERATOR = Internal(
    "keras.random.SeedGenerator's module", "GLOBAL_SEED_GENERATOR", "seeding", _SEED_GENERATOR
)

# Checked by `keras_internals.check()`.
REQUIRED = [KERAS_HOME, SET_GLOBAL_ATTRIBUTE, GLOBAL_RANDOM_SEED, GLOBAL_SEED_GENERATOR]


def keras_home() -> str:
    """The Keras home directory that Keras chose at import (KERAS_HOME, ~/.keras or
    /tmp/.keras when the home directory is read-only)."""
    return holder(KERAS_HOME).keras_home()


def set_global_seed(seed: int) -> None:
    """What `keras.utils.set_random_seed` does to Keras's own state, without importing
    TensorFlow on a JAX run (Keras's version imports it wherever it is installed)."""
    global_state = holder(SET_GLOBAL_ATTRIBUTE)
    global_state.set_global_attribute(holder(GLOBAL_RANDOM_SEED).GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(holder(GLOBAL_SEED_GENERATOR).GLOBAL_SEED_GENERATOR, None)


def global_seed_generator():
    """Keras's global SeedGenerator (what unseeded `keras.random` calls draw from), or None
    before anything created it."""
    global_state = holder(SET_GLOBAL_ATTRIBUTE)
    return global_state.get_global_attribute(holder(GLOBAL_SEED_GENERATOR).GLOBAL_SEED_GENERATOR)
