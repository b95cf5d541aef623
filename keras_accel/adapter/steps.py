"""The compiled-step layer: wrappers around a model's train/test/predict steps.

Keras compiles `model.train_step` (under `jax.jit` or `tf.function`), so the Python body of
that method runs only while a new program is traced. A thin wrapper installed on the model
instance therefore sees every trace, for free at steady state, on every backend. It does two
things there:

- counts the trace and the input shapes that caused it (the recompile guard);
- publishes the batch's row mask for BatchNormalization (`keras_accel.adapter.batchnorm`).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any

from keras_accel.adapter.batchnorm import ROW_MASK

STEP_KINDS = ("train", "test", "predict")


def _shapes(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _shapes(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return tuple(_shapes(item) for item in data)
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
        shapes = _shapes(data)
        key = (id(model), kind, repr(shapes))
        with self._lock:
            # Under tf.distribute one trace runs the step once per replica, with the same
            # shapes: those count once.
            if key in self._signatures:
                return
            self._signatures.add(key)
            trace = Trace(kind, shapes, after_warmup=(id(model), kind) in self._warm)
            self.traces.append(trace)
        if trace.after_warmup and self.warn:
            warnings.warn(
                f"keras_accel: `{kind}_step` was traced again after warm-up, for input shapes "
                f"{shapes}; every new shape costs a new compilation. Feed batches through the "
                "Accelerator (acc.fit / acc.evaluate / acc.predict / acc.dataset), which keeps "
                f"them one static shape. Recompiles so far: {self.num_recompiles}.",
                RuntimeWarning,
                stacklevel=2,
            )


_INSTRUMENTED = "_keras_accel_guard"


def _row_mask(data: Any):
    if isinstance(data, (list, tuple)) and len(data) == 3 and data[2] is not None:
        from keras import ops

        return ops.greater(data[2], 0)
    return None


def instrument(model, guard: RecompileGuard) -> None:
    """Install the step wrappers on `model` (once; a later call only swaps the guard)."""
    if getattr(model, _INSTRUMENTED, None) is not None:
        object.__setattr__(model, _INSTRUMENTED, guard)
        return
    for kind in STEP_KINDS:
        original = getattr(model, f"{kind}_step")

        def step(*args, _kind=kind, _original=original):
            # JAX steps are `step(state, data)`, TF and torch steps `step(data)`.
            data = args[-1]
            if not model.run_eagerly:
                getattr(model, _INSTRUMENTED).record(model, _kind, data)
            # Training mode needs the mask for BatchNormalization, every mode for metrics.
            token = ROW_MASK.set(_row_mask(data))
            try:
                return _original(*args)
            finally:
                ROW_MASK.reset(token)

        object.__setattr__(model, f"{kind}_step", step)
    object.__setattr__(model, _INSTRUMENTED, guard)
    # Step functions compiled before instrumenting call the unwrapped steps: rebuild them.
    model.train_function = model.test_function = model.predict_function = None


_MASKED = "_keras_accel_masked"


def mask_unweighted_metrics(model) -> None:
    """Make the compiled `metrics=` (which Keras updates without sample weights) skip
    padding rows: they get the row mask as their weight. `weighted_metrics=` already see the
    padded batch's sample weights, whose padding rows are 0."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None or getattr(compiled, _MASKED, False):
        return
    original = compiled.update_state

    def update_state(y_true, y_pred, sample_weight=None):
        if not compiled.built:
            compiled.build(y_true, y_pred)
        for metric in getattr(compiled, "_flat_metrics", []):
            if metric is not None and not getattr(metric, _MASKED, False):
                _mask_metric(metric)
        return original(y_true, y_pred, sample_weight=sample_weight)

    object.__setattr__(compiled, "update_state", update_state)
    object.__setattr__(compiled, _MASKED, True)


def _mask_metric(metric) -> None:
    original = metric.update_state

    def update_state(y_true, y_pred, sample_weight=None):
        mask = ROW_MASK.get()
        if sample_weight is None and mask is not None:
            from keras import ops

            sample_weight = ops.cast(mask, "float32")
        return original(y_true, y_pred, sample_weight=sample_weight)

    object.__setattr__(metric, "update_state", update_state)
    object.__setattr__(metric, _MASKED, True)
