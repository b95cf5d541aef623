"""JAX's distributed runtime: the client of its key-value store (`jax._src.distributed`),
which `jax.distributed.initialize` makes and JAX has no public accessor for."""

from __future__ import annotations

from keras_accel.utils.library_internals.lookup import Internal, find, missing

_GLOBAL_STATE = Internal(
    "JAX",
    "jax._src.distributed",
    "global_state",
    "the distributed runtime's key-value store (`global_state.client`), where the "
    "processes agree on the end of per-process data; JAX has no public accessor",
)
INTERNALS = [_GLOBAL_STATE]


def jax_distributed_client():
    """The JAX distributed runtime's client (`jax._src.distributed.global_state.client`):
    None before `jax.distributed.initialize`."""
    state = find(_GLOBAL_STATE)
    try:
        return state.client
    except AttributeError:
        raise missing(_GLOBAL_STATE) from None
