"""The recompile guard: every trace of a step function; a warning for a new one after warm-up."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Any


def shapes(data: Any) -> Any:
    """The nested shapes of a batch (None for leaves without a shape)."""
    if isinstance(data, dict):
        return {key: shapes(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return tuple(shapes(item) for item in data)
    shape = getattr(data, "shape", None)
    return None if shape is None else tuple(None if d is None else int(d) for d in shape)


@dataclasses.dataclass(frozen=True)
class Trace:
    """One trace of a step function: which step, the input shapes, and whether after warm-up."""

    kind: str
    shapes: Any
    after_warmup: bool


class RecompileGuard:
    """Counts step traces; after warm-up, warns once per new input signature.

    Warm-up ends per model and step kind: for "train" after the first epoch of `fit`, for
    "test" and "predict" after their first complete pass. A trace after that means a new
    compilation (on a TPU, seconds to minutes) that static batching should have prevented.
    Only the Accelerator's own calls are watched: a plain `model.fit` runs none of our code.
    """

    def __init__(self, warn: bool = True):
        self.warn = warn
        self.traces: list[Trace] = []
        self._warm: set[tuple[int, str]] = set()
        self._signatures: set[tuple[int, str, str]] = set()
        self._lock = threading.Lock()

    @property
    def num_recompiles(self) -> int:
        """Distinct new input signatures traced after warm-up, over all models and steps."""
        return sum(1 for trace in self.traces if trace.after_warmup)

    def mark_warm(self, model, kind: str) -> None:
        self._warm.add((id(model), kind))

    def record(self, model, kind: str, data: Any) -> None:
        if id(model) in _SAME_PROGRAM:
            return
        signature = shapes(data)
        key = (id(model), kind, repr(signature))
        with self._lock:
            # Under tf.distribute one trace runs the step once per replica, with the same
            # shapes; and a step compiled again for a later call with the same shapes is
            # not a new compilation the guard could have prevented: those count once.
            if key in self._signatures:
                return
            self._signatures.add(key)
            trace = Trace(kind, signature, after_warmup=(id(model), kind) in self._warm)
            self.traces.append(trace)
        if trace.after_warmup and self.warn:
            warnings.warn(
                f"keras_accel: `{kind}_step` was traced again after warm-up, for input shapes "
                f"{signature}; every new shape costs a new compilation. Feed batches through "
                "the Accelerator (acc.fit / acc.evaluate / acc.predict / acc.dataset), which "
                f"keeps them one static shape. Recompiles so far: {self.num_recompiles}.",
                RuntimeWarning,
                stacklevel=2,
            )


# Models whose step is being traced again at another call site of the same program (a fused
# loop's body, which TensorFlow compiles with the first call): not a compilation of its own.
# A set, not a contextvar: tf.distribute traces each replica's step in a thread of its own.
_SAME_PROGRAM: set[int] = set()


@contextlib.contextmanager
def same_program(model):
    """Traces of `model`'s steps in here belong to the program already being traced."""
    _SAME_PROGRAM.add(id(model))
    try:
        yield
    finally:
        _SAME_PROGRAM.discard(id(model))
