"""Where each variable of a model lies: `Accelerator.describe(model)`.

Each row is read from the variable's own array (its JAX sharding, its TF distributed values),
never from keras_accel's bookkeeping: what the report says is what the devices hold. A row
names the variable's path, its shape and dtype, its layout, the block each device holds and
that block's bytes; the totals say what one device holds of the model, of its optimizer and
of its metrics, against the whole.

Example:

A backend places each variable (`Runtime.placement`); here, a placement that splits every
variable's first dimension over 2 devices, to show what the report adds up:

>>> import keras
>>> from keras_accel.adapter import layouts
>>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="out")], name="net")
>>> def halves(variable):
...     shape = (variable.shape[0] // 2, *variable.shape[1:])
...     return layouts.Placement("P('batch')", shape, num_devices=2, itemsize=4)
>>> report = layouts.describe(model, halves, "net, halved:")
>>> [(row.path, row.per_device_shape, row.bytes_per_device) for row in report]
[('net/out/kernel', (2, 2), 16), ('net/out/bias', (1,), 4)]
>>> report.bytes_per_device("model"), report.total_bytes("model")
(20, 40)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

from keras_accel.state import tree

# Whose variables: the model's, its optimizer's, its metrics', Keras's global seed generator.
OWNERS = tree.GROUPS


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one array lies, as a backend reads it.

    Attributes:
        layout: how it is laid out: "replicated" (whole on each of its devices), a JAX
            `PartitionSpec` such as "P(None, 'batch')" (dimension 1 split over the mesh's
            batch axis), "mirrored" (a TF distributed variable), or the one device it is on.
        per_device_shape: the block of it that each device holds (the largest, where a
            dimension does not divide evenly).
        num_devices: how many devices hold a block of it.
        itemsize: bytes per element.
    """

    layout: str
    per_device_shape: tuple
    num_devices: int
    itemsize: int


@dataclasses.dataclass(frozen=True)
class VariableLayout:
    """One variable's row: its path, `owner` ("model", "optimizer", "metrics", "seed"), shape,
    dtype, and where it lies (`Placement`'s fields)."""

    path: str
    owner: str
    shape: tuple
    dtype: str
    layout: str
    per_device_shape: tuple
    num_devices: int
    itemsize: int

    @property
    def bytes_per_device(self) -> int:
        """Bytes of this variable on each device that holds a block of it."""
        return math.prod(self.per_device_shape) * self.itemsize

    @property
    def total_bytes(self) -> int:
        """Bytes of the whole variable (what one device holds where it is replicated)."""
        return math.prod(self.shape) * self.itemsize


class LayoutReport(Sequence):
    """The rows of `Accelerator.describe(model)`, one per variable, the model's first, then
    the optimizer's, the metrics' and Keras's global seed generator's; `str()` is a table
    with the totals."""

    def __init__(self, title: str, rows: list[VariableLayout]):
        self.title = title
        self.rows = list(rows)

    def __getitem__(self, index):
        return self.rows[index]

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[VariableLayout]:
        return iter(self.rows)

    def _of(self, owner: str | None) -> list[VariableLayout]:
        if owner is not None and owner not in OWNERS:
            raise ValueError(
                f"`owner` must be one of {OWNERS} or None for all. Received: owner={owner!r}"
            )
        return [row for row in self.rows if owner is None or row.owner == owner]

    def bytes_per_device(self, owner: str | None = None) -> int:
        """Bytes one device holds of the variables of `owner` ("model", "optimizer",
        "metrics", "seed"; None: all). Every device holds as much, but for uneven blocks."""
        return sum(row.bytes_per_device for row in self._of(owner))

    def total_bytes(self, owner: str | None = None) -> int:
        """Bytes of those variables whole, as one device would hold them unsharded."""
        return sum(row.total_bytes for row in self._of(owner))

    def __str__(self) -> str:
        header = ("variable", "shape", "dtype", "layout", "per device", "bytes")
        table = [header] + [
            (
                row.path,
                _shape(row.shape),
                row.dtype,
                row.layout,
                _shape(row.per_device_shape),
                _size(row.bytes_per_device),
            )
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [self.title]
        for line in table:
            cells = [cell.ljust(width) for cell, width in zip(line[:-1], widths)]
            lines.append("  ".join([*cells, line[-1].rjust(widths[-1])]).rstrip())
        totals = [
            f"{owner} {_size(self.bytes_per_device(owner))} of {_size(self.total_bytes(owner))}"
            for owner in OWNERS
            if self._of(owner)
        ]
        lines.append("per device: " + "; ".join(totals) if totals else "no variables")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<LayoutReport of {len(self.rows)} variables>\n{self}"


def describe(model, place, title: str) -> LayoutReport:
    """The report of `model`'s variables (those a backup saves, `keras_accel.state.tree`),
    each placed by `place(variable) -> Placement`."""
    rows = []
    for key, variable in tree.variables(model).items():
        rows.append(
            VariableLayout(
                path=variable.path,
                owner=key.partition("/")[0],
                shape=tuple(variable.shape),
                dtype=str(variable.dtype),
                **dataclasses.asdict(place(variable)),
            )
        )
    return LayoutReport(title, rows)


def itemsize(dtype) -> int:
    """Bytes per element of a Keras dtype name ("float32", "bfloat16", "int8", "bool"), read
    from the name: numpy has no bfloat16, and torch's and TF's dtypes are not numpy's.

    >>> itemsize("float32"), itemsize("bfloat16"), itemsize("bool"), itemsize("float8_e4m3fn")
    (4, 2, 1, 1)
    """
    name = str(dtype)
    bits = re.search(r"\d+", name)
    if bits is None:
        if name == "bool":
            return 1
        raise ValueError(f"No size known for dtype {name!r}. Received: dtype={dtype!r}")
    return max(int(bits.group()) // 8, 1)


def _shape(shape: tuple) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"
