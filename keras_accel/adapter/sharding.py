"""Where a fully sharded strategy puts each variable: the rule, on shapes alone.

Under `strategy="fsdp"` every variable (weights, optimizer slots, metrics' own) is split
over the mesh's data axis along one of its dimensions, so that each device holds 1/N of
the model's state, and the compiled step gathers what it needs (ZeRO-3 / FSDP, done by
XLA's partitioner from the layouts). The dimension is the largest that the data axis
divides and that no other axis (a `LayoutMap`'s model axis) already splits; ties go to
the first. A variable with no such dimension (a scalar, a bias of 3 classes on 8 devices)
stays whole on every device.
"""

from __future__ import annotations


def fully_sharded_axes(shape, axes, axis: str, size: int) -> tuple:
    """`axes` (one mesh axis name or None per dimension of `shape`) with `axis` placed on
    the largest free dimension that `size` divides; unchanged where none does, or where
    `axis` is already used.

    >>> fully_sharded_axes((6, 16), (None, None), "batch", 8)
    (None, 'batch')
    >>> fully_sharded_axes((32, 16), (None, "model"), "batch", 8)
    ('batch', 'model')
    >>> fully_sharded_axes((3,), (None,), "batch", 8)
    (None,)
    """
    shape, axes = tuple(shape), tuple(axes)
    if len(shape) != len(axes):
        raise ValueError(
            f"A layout needs one axis per dimension. Received: shape={shape} with axes={axes}"
        )
    if size <= 1 or axis in axes:
        return axes
    free = [
        i
        for i, (dim, used) in enumerate(zip(shape, axes))
        if used is None and isinstance(dim, int) and dim >= size and dim % size == 0
    ]
    if not free:
        return axes
    chosen = max(free, key=lambda i: (shape[i], -i))
    return tuple(axis if i == chosen else used for i, used in enumerate(axes))


def is_replicated(axes) -> bool:
    """Whether a layout's axes leave the variable whole on every device."""
    return all(a is None for a in axes)
