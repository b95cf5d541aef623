"""The recompile guard: every trace of a step function; a warning for each one after warm-up."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
import weakref
from typing import Any

import keras

# Why a step was traced (`Trace.cause`).
FIRST = "first trace"
NEW_SHAPES = "new input shapes"
NEW_DTYPES = "new input dtypes"
RETRACE = "same shapes and dtypes traced again"


def shapes(data: Any) -> Any:
    """The nested shapes of a batch (None for leaves without a shape)."""
    return _leaves(data, _shape)


def dtypes(data: Any) -> Any:
    """The nested dtype names of a batch (None for leaves without a dtype)."""
    return _leaves(data, _dtype)


def _leaves(data: Any, fn) -> Any:
    if isinstance(data, dict):
        return {key: _leaves(value, fn) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return tuple(_leaves(item, fn) for item in data)
    return fn(data)


def _shape(leaf: Any):
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(None if d is None else int(d) for d in shape)


def _dtype(leaf: Any):
    dtype = getattr(leaf, "dtype", None)
    if dtype is None:
        return None
    try:
        return keras.backend.standardize_dtype(dtype)
    except ValueError:  # A dtype Keras has no name for: its own.
        return str(dtype)


@dataclasses.dataclass(frozen=True)
class Trace:
    """One trace of a step function (one compilation): which step, its input shapes and
    dtypes, whether after warm-up, and why it was traced (`FIRST`, `NEW_SHAPES`,
    `NEW_DTYPES` or `RETRACE`)."""

    kind: str
    shapes: Any
    after_warmup: bool
    dtypes: Any = None
    cause: str = FIRST


class _Seen:
    """What the guard knows of one model."""

    def __init__(self):
        self.warm: set[str] = set()
        self.shapes: set[tuple[str, str]] = set()
        # (kind, signature) -> the trace that recorded it last (`_trace`).
        self.signatures: dict[tuple[str, str], Any] = {}


class RecompileGuard:
    """Counts step traces; after warm-up, warns at each one, naming its cause.

    Every trace of a step is a compilation (on a TPU, seconds to minutes). Its cause is a
    new input shape, a new input dtype, or neither: the same signature traced again, because
    something the compiled step closes over changed (compile() again, another optimizer,
    steps_per_execution...). One compilation counts once, however often it runs the step's
    Python: once per replica under tf.distribute, twice on TensorFlow's first call where
    variables are made, again in a fused loop's body (`same_program`); see `_trace`.

    Warm-up ends per model and step kind: for "train" after the first epoch of `fit`, for
    "test" and "predict" after their first complete pass. Only the Accelerator's own calls
    are watched: a plain `model.fit` runs none of our code. Models are held weakly: one that
    is garbage-collected is forgotten, and a new one is never taken for it.
    """

    def __init__(self, warn: bool = True):
        self.warn = warn
        self.traces: list[Trace] = []
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    @property
    def num_recompiles(self) -> int:
        """Traces (compilations) after warm-up, over all models and steps."""
        return sum(1 for trace in self.traces if trace.after_warmup)

    def _of(self, model) -> _Seen:
        seen = self._seen.get(model)
        if seen is None:
            seen = self._seen[model] = _Seen()
        return seen

    def mark_warm(self, model, kind: str) -> None:
        with self._lock:
            self._of(model).warm.add(kind)

    def is_warm(self, model, kind: str) -> bool:
        with self._lock:
            seen = self._seen.get(model)
            return seen is not None and kind in seen.warm

    def record(self, model, kind: str, data: Any) -> None:
        if id(model) in _SAME_PROGRAM:
            return
        trace_id = _trace(model, kind, data)
        if trace_id is _NOT_TRACING:
            return
        shape, dtype = shapes(data), dtypes(data)
        shape_key = (kind, repr(shape))
        key = (kind, repr((shape, dtype)))
        with self._lock:
            seen = self._of(model)
            if key in seen.signatures:
                last = seen.signatures[key]
                if trace_id is _EAGER or _same(last, trace_id):
                    return  # Part of a trace already counted (see `_trace`).
                cause = RETRACE
            elif shape_key in seen.shapes:
                cause = NEW_DTYPES
            else:
                cause = NEW_SHAPES if any(k == kind for k, _ in seen.shapes) else FIRST
            seen.shapes.add(shape_key)
            seen.signatures[key] = _ref(trace_id)
            trace = Trace(kind, shape, kind in seen.warm, dtype, cause)
            self.traces.append(trace)
        if trace.after_warmup and self.warn:
            warnings.warn(_message(trace, self.num_recompiles), RuntimeWarning, stacklevel=2)


def _message(trace: Trace, count: int) -> str:
    if trace.cause == NEW_DTYPES:
        fix = (
            "Feed every batch in the dtypes of the first (cast the data once, e.g. "
            "x.astype('float32'))."
        )
    elif trace.cause == RETRACE:
        fix = (
            "Its input signature was traced before: something the compiled step depends on "
            "changed since (compile() called again, another optimizer, loss or metrics, "
            "jit_compile, fusion switched on or off by a callback that needs every batch, "
            "or padding rows where an earlier call with sample weights had none)."
        )
    else:
        fix = (
            "Feed batches through the Accelerator (acc.fit / acc.evaluate / acc.predict / "
            "acc.dataset), which keeps them one static shape."
        )
    return (
        f"keras_accel: `{trace.kind}_step` was traced again after warm-up ({trace.cause}), "
        f"for input shapes {trace.shapes} and dtypes {trace.dtypes}; every trace costs a new "
        f"compilation. {fix} Recompiles so far: {count}."
    )


_NOT_TRACING = object()  # The step runs eagerly: nothing is compiled.
_EAGER = object()  # A backend that runs steps eagerly: each signature counted once.


def _trace(model, kind: str, data: Any):
    """What identifies the compilation tracing `model`'s step on `data` now, or
    `_NOT_TRACING` where the step runs eagerly.

    TensorFlow: the step function Keras is tracing (`model.train_function`...). It traces
    the step more than once for one program: once per replica under tf.distribute (in
    threads), and twice on its first call where that trace made variables (TensorFlow's
    variable-creating trace, then the one it keeps). Another program for a signature
    already traced needs another function (compile() again, another contract...).
    JAX: a new object, since `jax.jit` runs the step's Python once per trace, whose inputs
    are tracers; a step on concrete arrays runs eagerly (`jit_compile=False`).
    torch: eager steps compile nothing (`_NOT_TRACING`); under `jit_compile=True`
    (`torch.compile`) each new signature is a compilation, `_EAGER`, counted once.
    """
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.executing_eagerly():
            return _NOT_TRACING
        function = getattr(model, f"{kind}_function", None)
        return tf.compat.v1.get_default_graph() if function is None else function
    if backend == "jax":
        import jax

        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(data))
        return object() if traced else _NOT_TRACING
    if backend == "torch" and not getattr(model, "jit_compile", False):
        return _NOT_TRACING  # Keras runs torch steps eagerly: a new shape compiles nothing.
    return _EAGER


def _ref(trace_id):
    try:
        return weakref.ref(trace_id)
    except TypeError:  # object() and _EAGER: nothing to hold weakly; never the same again.
        return trace_id


def _same(last, trace_id) -> bool:
    if isinstance(last, weakref.ref):
        return last() is trace_id
    return last is trace_id


# Models whose step is being traced again at another call site of the same program (a fused
# loop's body, which TensorFlow compiles with the first call): not a compilation of its own.
# A set, not a contextvar: tf.distribute traces each replica's step in a thread of its own.
# Ids are safe here: the model is alive for as long as it is in the set.
_SAME_PROGRAM: set[int] = set()


@contextlib.contextmanager
def same_program(model):
    """Traces of `model`'s steps in here belong to the program already being traced."""
    _SAME_PROGRAM.add(id(model))
    try:
        yield
    finally:
        _SAME_PROGRAM.discard(id(model))
