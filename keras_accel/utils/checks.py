"""Argument checks written once, in Keras's wording ("`name` must be ... Received: ...")."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer (Python's or numpy's), and not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_positive_int(name: str, value, error: type[Exception] = ValueError) -> int:
    """`value` as an int when it is an integer >= 1, else `error` naming `name`.

    >>> check_positive_int("batch_size", 32)
    32
    >>> check_positive_int("batch_size", True)
    Traceback (most recent call last):
    ...
    ValueError: `batch_size` must be a positive integer. Received: batch_size=True
    """
    if not is_int(value) or value < 1:
        raise error(f"`{name}` must be a positive integer. Received: {name}={value!r}")
    return int(value)


def check_count(name: str, value, allow_none: bool = False) -> int | None:
    """`value` when it is an integer >= 0 (or None where `allow_none`), else ValueError.

    >>> check_count("num_samples", 0)
    0
    """
    if value is None and allow_none:
        return None
    if not is_int(value) or value < 0:
        also = " or None" if allow_none else ""
        raise ValueError(f"`{name}` must be an integer >= 0{also}. Received: {name}={value!r}")
    return int(value)
