"""One custom training loop for JAX, TensorFlow and torch: the user writes the loop,
keras_accel compiles the step (torch runs it eagerly, as Keras's torch trainer does).

The first seed's custom loop is TensorFlow-only: `tf.data` batched per replica, a
`@tf.function` step run by `strategy.run`, a loss averaged with
`tf.nn.compute_average_loss(per_example_loss, global_batch_size=...)`, metrics built in the
strategy's scope. In Keras 3 the same loop must be written again for JAX (`stateless_call`,
`jax.value_and_grad`, `jax.jit` with shardings) and for torch (`backward`, a gradient
all-reduce over `torch.distributed`). `Accelerator.loop` gives one loop for all three:

>>> import keras, numpy as np
>>> from keras_accel import Accelerator
>>> acc = Accelerator(seed=0)
>>> with acc.scope():  # the model and its optimizer live on the Accelerator's devices
...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
...     optimizer = keras.optimizers.SGD(0.1)
>>> loop = acc.loop(
...     model,
...     optimizer=optimizer,
...     loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
...     metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
... )
>>> x, y = np.random.rand(50, 4).astype("float32"), np.random.randint(0, 3, 50)
>>> for epoch in range(2):
...     loop.reset_metrics()
...     for batch in loop.batches(x, y, batch_size=16, shuffle=True, epoch=epoch):
...         loop.train_step(batch)
...     logs = loop.results()                   # plain Python floats
>>> sorted(logs)
['accuracy', 'loss']
>>> loop.predict(x, batch_size=16).shape     # exactly one row per input row
(50, 3)

What the loop guarantees:

- **The loss is the global batch's mean**, as `compute_average_loss` computes it: the sum of
  the (weighted) per-example losses over the real rows of the whole global batch, divided by
  their number. Results do not depend on the replica count, and padding rows (the
  Accelerator's static batches) count nowhere. A Keras `Loss` object is used unreduced (its
  `call`); a plain function must return per-example losses.
- **Metrics over every replica's rows**: the loss tracker and the metrics given are updated
  with the row mask (`weighted_metrics` with the sample weights too), and `results()` reads
  them across replicas.
- **Keras optimizers as they are**: gradient clipping (`clipnorm`, `global_clipnorm`: of the
  global gradient, on every backend), gradient accumulation, and loss scaling under
  `mixed_precision="float16"` (the optimizer is wrapped in Keras's `LossScaleOptimizer`).
- **Static shapes**: `batches()` are the Accelerator's padded batches of one shape, so the
  step compiles once; `evaluate` and `predict` are exact.
- **No trace**: what the step needs on the model (BatchNormalization over real rows) is
  installed for the duration of each call only.

The compiled steps are one small module per backend (`keras_accel.loop.backends`), each a
pure step function over an explicit state, which is what running N of them per host call
(host-loop fusion) needs.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import keras
import numpy as np

from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer

__all__ = ["CustomLoop", "StepGroup"]


def per_example_losses(loss, y_true, y_pred, weights=None):
    """The weighted loss of every row: `[batch]`, from a Keras `Loss` (used unreduced) or a
    function, times `weights`.

    A loss with one value per time step or pixel (sequence targets) is the mean of its
    row's values, weighted by per-step weights where `weights` has them (a temporal
    `(batch, steps)` weight); where the prediction carries a Keras mask
    (`Embedding(mask_zero=True)`), the mean over the row's unmasked steps.

    Weights weigh the loss's values as Keras weighs them: the values' shape or its first
    axes (`(rows,)` up to the values' shape; an axis of 1 broadcasts, one trailing axis of
    1 is squeezed). A loss with one value per row takes `(rows,)` or `(rows, 1)`; per-step
    weights `(rows, steps)` need a loss with one value per step.

    Raises:
        ValueError: the loss is a scalar (already reduced over the batch: padding and
            weights could not be accounted for), or its first axis is not the batch's, or
            the weights do not fit its values (per-step weights for a loss with one value
            per row broadcast into `(rows, rows)` before, or failed deep in the step); the
            message names both shapes.
    """
    from keras import ops

    step_mask = keras_internals.keras_mask(keras.tree.flatten(y_pred)[0])
    if isinstance(loss, keras.losses.Loss):
        # As Loss.__call__ does before its reduction: in the loss's dtype (float32 under a
        # mixed-precision policy, where predictions are float16 or bfloat16).
        dtype = loss.dtype or keras.config.floatx()
        y_pred = keras.tree.map_structure(lambda t: ops.cast(t, dtype), y_pred)
        values = loss.call(y_true, y_pred)
    else:
        values = loss(y_true, y_pred)
    # Losses are summed over the global batch in float32, whatever the compute dtype.
    values = ops.cast(ops.convert_to_tensor(values), "float32")
    rows = keras.tree.flatten(y_pred)[0].shape[0]
    if len(values.shape) == 0:
        raise ValueError(
            "The loss must return one loss per example (shape (batch,)), which keras_accel "
            "averages over the global batch, as tf.nn.compute_average_loss does. Received: "
            f"a scalar from {_name(loss)}. Pass a keras.losses.Loss (it is used unreduced), "
            "or a function that does not reduce over the batch."
        )
    if values.shape[0] is not None and rows is not None and values.shape[0] != rows:
        raise ValueError(
            f"The loss must return one loss per example: its first axis must be the "
            f"batch's, {rows} rows. Received: shape {tuple(values.shape)} from {_name(loss)}."
        )
    if weights is not None:
        _check_loss_weights(_shape(values), _shape(weights), loss)
        weights = ops.cast(weights, "float32")
    if len(values.shape) == 1:
        return values if weights is None else values * _row_weights(weights, values)
    # Per-timestep or per-pixel losses: their (weighted, unmasked) mean per example.
    axes = tuple(range(1, len(values.shape)))
    counted = ops.ones_like(values)
    if step_mask is not None and len(step_mask.shape) == len(values.shape):
        counted = ops.cast(step_mask, "float32")
    steps = ops.maximum(ops.sum(counted, axis=axes), 1.0)
    if weights is not None and len(weights.shape) > 1:
        counted = counted * _to_rank(weights, len(values.shape))
        weights = None
    per = ops.sum(values * counted, axis=axes) / steps
    return per if weights is None else per * weights


def _shape(tensor) -> tuple:
    """The static shape, an unknown (traced) size as None."""
    return tuple(None if d is None else int(d) for d in np.shape(tensor))


def _fits(weights_shape: tuple, shape: tuple) -> bool:
    """Whether weights of `weights_shape` weigh values of `shape` as Keras weighs them: at
    most one axis more than the values, a trailing 1 (squeezed); each axis the values' or 1
    (broadcast), the values' axes beyond the weights' rank taking each weight whole. Unknown
    (traced) sizes fit."""
    if len(weights_shape) > len(shape):
        if len(weights_shape) > len(shape) + 1 or weights_shape[-1] != 1:
            return False
        weights_shape = weights_shape[:-1]
    return all(w in (None, 1) or v is None or w == v for w, v in zip(weights_shape, shape))


def _check_loss_weights(values_shape: tuple, weights_shape: tuple, loss) -> None:
    """Raise where the weights cannot weigh the loss's values: per-step weights `(rows,
    steps)` for a loss with one value per row would broadcast into `(rows, rows)` or fail
    deep in the step."""
    if _fits(weights_shape, values_shape):
        return
    rows = values_shape[0]
    if len(values_shape) == 1:
        what = (
            f"The loss returns one value per row, shape {values_shape}, from {_name(loss)}, and "
            f"the weights have shape {weights_shape}. A loss with one value per row takes "
            f"weights of shape ({rows},) or ({rows}, 1). Weights per step, (rows, steps), need "
            "a loss with one value per step: a Keras loss (the loop uses it unreduced, as "
            'reduction="none" gives) on a (rows, steps, classes) prediction, e.g. '
            "SparseCategoricalCrossentropy on (rows, steps) targets, or a function that "
            "returns (rows, steps)."
        )
    else:
        what = (
            f"The loss returns values of shape {values_shape} from {_name(loss)}, and the "
            f"weights have shape {weights_shape}. Weights must have the loss values' shape or "
            f"its first axes, (rows,) up to {values_shape} (an axis of 1 broadcasts, one "
            "trailing axis of 1 is squeezed)."
        )
    raise ValueError(f"{what} Pass sample_weight of a shape that fits the loss.")


def _check_metric_weights(weights_shape: tuple, y_pred) -> None:
    """Raise where the weighted metrics' weights cannot weigh any metric of this
    prediction: a metric has at most one value per prediction element (most reduce its last
    axis: one per row and step of a `(rows, steps, classes)` prediction)."""
    shape = _shape(keras.tree.flatten(y_pred)[0])
    if _fits(weights_shape, shape):
        return
    raise ValueError(
        f"The weighted metrics' weights have shape {weights_shape} and the prediction has "
        f"shape {shape}: a metric has at most one value per prediction element, and most "
        f"(accuracy, the losses as metrics) one per row, or per row and step, the "
        "prediction's last axis reduced. Weights per step, (rows, steps), need a prediction "
        "per step, (rows, steps, classes); a prediction with one value per row takes weights "
        "of shape (rows,) or (rows, 1)."
    )


def _to_rank(weights, rank: int):
    """Weights of a loss per step, `(rows, steps)`, brought to the loss's rank as Keras
    does: a trailing axis of 1 squeezed, or axes of 1 appended (`(rows, 1)` broadcasts)."""
    from keras import ops

    while len(weights.shape) > rank and weights.shape[-1] == 1:
        weights = ops.squeeze(weights, axis=-1)
    if len(weights.shape) < rank:
        weights = ops.reshape(weights, tuple(weights.shape) + (1,) * (rank - len(weights.shape)))
    return weights


def _row_weights(weights, values):
    """Weights for one loss per row: `(rows,)`, or `(rows, 1)` squeezed."""
    from keras import ops

    if len(weights.shape) == 2 and weights.shape[-1] == 1:
        return ops.squeeze(weights, axis=-1)
    return weights


def _metric_weights(weights, y_pred):
    """A row's weight, `(rows,)`, shaped for a metric of this prediction: one value per row
    and step (the prediction's last axis reduced), as Keras's metrics compute them; per-step
    weights as they are; and as the Keras mask where the prediction has one (Keras folds
    the mask into the weights in place, which torch cannot broadcast)."""
    from keras import ops

    leaf = keras.tree.flatten(y_pred)[0]
    rank = max(1, len(leaf.shape) - 1)
    if len(weights.shape) < rank:
        weights = ops.reshape(weights, (-1,) + (1,) * (rank - 1))
    step_mask = keras_internals.keras_mask(leaf)
    if step_mask is not None and len(step_mask.shape) == len(weights.shape):
        weights = weights * ops.ones_like(step_mask, dtype=weights.dtype)
    return weights


def metric_updates(loop, y_true, y_pred, per_example, weights, mask):
    """`(metric, args, sample_weight)` for each of the loop's metrics, in `all_metrics()`
    order: what every backend's step updates them with. The loss tracker averages the
    weighted per-example losses (`per_example_losses(..., weights)`) over the real rows;
    metrics count the real rows; weighted metrics weigh them by the sample weights too.
    Padding rows count nowhere.

    Raises:
        ValueError: there are weighted metrics and the weights do not fit the prediction
            (per-step weights `(rows, steps)` for a prediction per row, `(rows, classes)`).
    """
    from keras import ops

    yield loop.loss_tracker, (per_example,), mask
    row_mask = _metric_weights(ops.cast(mask, "float32"), y_pred)
    for metric in loop.metrics:
        yield metric, (y_true, y_pred), row_mask
    if loop.weighted_metrics:
        _check_metric_weights(_shape(weights), y_pred)
        weighted = ops.cast(weights, "float32")
        if len(weighted.shape) > 1:
            weighted = weighted * _to_rank(ops.cast(mask, "float32"), len(weighted.shape))
        else:
            weighted = weighted * ops.cast(mask, "float32")
        weighted = _metric_weights(weighted, y_pred)
        for metric in loop.weighted_metrics:
            yield metric, (y_true, y_pred), weighted


def update_metrics(loop, y_true, y_pred, per_example, weights, mask, update=None) -> None:
    """Update the loop's metric variables in place with one batch (TensorFlow and torch;
    JAX's step updates its explicit state with `metric_updates` itself). Each replica or
    process updates with its own rows; reading the results sums them across.

    `update(metric, y_true, y_pred, sample_weight)`, where given, updates each of the
    compiled or given metrics instead of its `update_state` (torch gathers the global
    batch's rows for users' metrics there); the loss tracker, a Keras `Mean`, is updated
    directly."""
    for metric, args, sample_weight in metric_updates(
        loop, y_true, y_pred, per_example, weights, mask
    ):
        if update is None or metric is loop.loss_tracker:
            metric.update_state(*args, sample_weight=sample_weight)
        else:
            update(metric, *args, sample_weight)


def _name(loss) -> str:
    return getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__


class StepGroup:
    """Up to `steps_per_execution` consecutive batches that `train_step` or `test_step`
    runs in one compiled call (host-loop fusion). `len(group)` is how many batches it holds;
    the last group of an epoch may hold fewer, and runs the same program."""

    def __init__(self, payload, steps: int):
        self.payload = payload
        self.steps = steps

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        return f"StepGroup(steps={self.steps})"


class LoopBatches:
    """One epoch of the Accelerator's static batches, ready for a loop's steps: single
    batches, or `StepGroup`s of `steps_per_execution` batches."""

    def __init__(
        self, loop: CustomLoop, batches, training: bool, epoch: int, steps_per_execution: int
    ):
        self.loop = loop
        self.source = batches
        self.training = training
        self.steps_per_execution = steps_per_execution
        if hasattr(batches, "epoch"):
            batches.epoch = epoch
        self.plan = batches.plan

    def __len__(self) -> int:
        """Iterations: batches, or groups of them when fused."""
        if self.plan.num_batches is None:
            raise TypeError(
                f"These batches have no length: {self.plan.describe()}. Iterate them (the "
                "epoch ends where the data ends), or pass a data set that knows its length."
            )
        return -(-self.plan.num_batches // self.steps_per_execution)

    def __iter__(self):
        backend = self.loop._backend
        if self.steps_per_execution > 1:
            return iter(backend.groups(self.source, self.training, self.steps_per_execution))
        return iter(backend.distributed(self.source, self.training))


class CustomLoop:
    """A model, its optimizer, loss and metrics, and compiled train/test/predict steps.

    Built by `Accelerator.loop`; see the module docstring for an example and the
    guarantees. `optimizer`, `loss` and `metrics` default to what the model was compiled
    with. Metrics are Keras `Metric` objects (or names, as in `compile`); the loss tracker
    is named "loss".
    """

    def __init__(
        self,
        accelerator,
        model: keras.Model,
        optimizer=None,
        loss=None,
        metrics: list | None = None,
        weighted_metrics: list | None = None,
    ):
        accelerator.prepare(model)
        self.accelerator = accelerator
        self.model = model
        with accelerator.scope():
            self.optimizer = _optimizer(model, optimizer, accelerator)
            _check_placed(accelerator, self.optimizer)
            if not self.optimizer.built:
                # Here, in the scope, not lazily inside a compiled (replicated) step.
                self.optimizer.build(model.trainable_variables)
            self.loss = _loss(model, loss)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            # Metrics named as `compile` names them ("accuracy") are resolved from the first
            # batch's targets and the model's outputs, as Keras resolves them (`batches()`).
            self._unresolved: list[tuple[str, bool]] = []
            if metrics is None and weighted_metrics is None:
                metrics, weighted_metrics = _compiled_metrics(model)
                self.metrics = self._from_compile(metrics, weighted=False)
                self.weighted_metrics = self._from_compile(weighted_metrics, weighted=True)
            else:
                self.metrics = [_metric(m) for m in (metrics or [])]
                self.weighted_metrics = [_metric(m) for m in (weighted_metrics or [])]
        backend = keras.backend.backend()
        if backend not in ("jax", "tensorflow", "torch"):
            raise NotImplementedError(
                f"Accelerator.loop runs on JAX, TensorFlow and torch. Received: "
                f"KERAS_BACKEND={backend!r}."
            )
        module = importlib.import_module(f"keras_accel.loop.backends.{backend}")
        self._backend = module.Steps(self)
        self._structure = {}
        self._batches_cache = None

    # ------------------------------------------------------------------ data
    def batches(
        self,
        x: Any,
        y: Any = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        sample_weight: Any = None,
        epoch: int = 0,
        training: bool = True,
        steps_per_execution: int | str = "auto",
    ) -> LoopBatches:
        """The Accelerator's static-shape batches of one epoch, placed for the steps.

        With `steps_per_execution=N` > 1 it yields `StepGroup`s of N batches instead, each
        run by one `train_step` (or `test_step`) call as one compiled program: the host's
        per-call cost is paid once per N steps, and the results equal N single steps. The
        loop body then runs once per group. "auto" (default) takes the Accelerator's
        setting when that is an int, else 1: unlike `fit`'s callbacks, a loop's body is the
        user's own code, and whether it needs every batch cannot be seen from outside.

        Args:
            x, y, sample_weight: arrays (or a `PyDataset` / `tf.data.Dataset` yielding
                `(x, y[, sample_weight])`), as for `Accelerator.fit`.
            batch_size: the global batch (all replicas together), default 32 for arrays.
            shuffle: a new row order every epoch, a function of (seed, epoch).
            epoch: which epoch's order (so a resumed loop sees the same batches).
            training: False pads every row in, for exact evaluation (and never drops).
            steps_per_execution: batches per `StepGroup` ("auto" or a positive int).
        """
        from keras_accel.adapter import fusion

        n = fusion.check(steps_per_execution)
        if n == fusion.AUTO:
            chosen = self.accelerator.steps_per_execution
            n = 1 if chosen == fusion.AUTO else chosen
        acc = self.accelerator
        remainder = acc.remainder or "pad"
        # Several processes each read their own files of a file-backed tf.data pipeline,
        # where they can (all agree on it), as `fit` does.
        batches = acc.feeder.batches(
            x, y, batch_size, shuffle, sample_weight, None, training, remainder, True
        )
        if training and not batches.has_targets:
            raise ValueError(
                "train_step needs targets: pass y (or a data set that yields (x, y)). "
                "Received: y=None."
            )
        if self._unresolved and batches.has_targets:
            self._resolve(batches)
        return LoopBatches(self, batches, training, epoch, n)

    def _from_compile(self, metrics: list, weighted: bool) -> list:
        """Fresh metrics for the ones the model was compiled with: the loop's own state,
        never the state `fit` reports."""
        out = []
        for metric in metrics:
            if isinstance(metric, str) and metric.lower() in _BY_TARGETS:
                self._unresolved.append((metric, weighted))
            elif isinstance(metric, keras.metrics.Metric):
                out.append(type(metric).from_config(metric.get_config()))
            else:
                out.append(_metric_from_identifier(metric))
        return out

    def _resolve(self, batches) -> None:
        from keras_accel.data.sources import sample_batch

        x, y, _, _ = sample_batch(batches)
        try:
            y_pred = _output_spec(self.model, x)
        except Exception:  # Raw inputs a preprocessor turns into the model's (keras-hub).
            y_pred = None
        with self.accelerator.scope():
            for name, weighted in self._unresolved:
                metric = _accuracy(name, y, y_pred, self.loss)
                (self.weighted_metrics if weighted else self.metrics).append(metric)
        self._unresolved = []

    # ------------------------------------------------------------------ steps
    def train_step(self, batch) -> None:
        """One optimizer step on one of `batches()`' batches (or one per batch of a
        `StepGroup`, in one compiled call). Returns nothing, so that no step waits for the
        device; read `results()` when numbers are wanted."""
        self._check_resolved()
        with self.accelerator.scope():
            if isinstance(batch, StepGroup):
                self._backend.train_group(batch)
                return
            self._check_structure("train", batch)
            self._backend.train(batch)

    def test_step(self, batch) -> None:
        """Update the loss tracker and metrics on one batch (or a `StepGroup`), without
        training."""
        self._check_resolved()
        with self.accelerator.scope():
            if isinstance(batch, StepGroup):
                self._backend.test_group(batch)
                return
            self._check_structure("test", batch)
            self._backend.test(batch)

    def predict_step(self, batch):
        """The model's outputs for one batch (padding rows included)."""
        if isinstance(batch, StepGroup):
            raise ValueError(
                "predict_step takes one batch: its outputs come back per batch. Received: "
                f"{batch!r}. Iterate loop.batches(..., steps_per_execution=1) for "
                "prediction, or call loop.predict(x)."
            )
        self._check_structure("predict", batch)
        with self.accelerator.scope():
            return self._backend.predict(batch)

    def _check_structure(self, kind: str, batch) -> None:
        structure = keras.tree.map_structure(lambda _: None, batch)
        seen = self._structure.setdefault(kind, structure)
        if seen != structure:
            raise ValueError(
                f"{kind}_step received a batch of another structure than the first one: "
                f"{structure} instead of {seen}. Every batch of a loop must have one "
                "structure (feed them from loop.batches())."
            )

    # ------------------------------------------------------------------ results
    def all_metrics(self) -> list:
        return [self.loss_tracker, *self.metrics, *self.weighted_metrics]

    def _check_resolved(self) -> None:
        if self._unresolved:
            names = ", ".join(repr(name) for name, _ in self._unresolved)
            raise ValueError(
                f"The model was compiled with {names}, which Keras resolves from the targets "
                "(sparse, one-hot or binary accuracy), and this loop has seen no targets yet. "
                "Run a step on a batch of loop.batches(x, y, ...) first, or pass "
                "metrics=[keras.metrics.SparseCategoricalAccuracy('accuracy')] (or the one "
                "that fits your labels) to acc.loop."
            )

    def results(self) -> dict[str, float]:
        """The loss and every metric since the last `reset_metrics()`, as Python floats,
        over every replica's rows."""
        self._backend.sync()
        out = {}
        # torch: each process holds its rows' state; reading sums it over the processes.
        reading = getattr(self._backend, "reading", contextlib.nullcontext)
        with reading():
            for metric in self.all_metrics():
                value = metric.result()
                if isinstance(value, dict):
                    out.update({k: float(keras.ops.convert_to_numpy(v)) for k, v in value.items()})
                else:
                    out[metric.name] = float(keras.ops.convert_to_numpy(value))
        return out

    def reset_metrics(self) -> None:
        self._backend.sync()
        for metric in self.all_metrics():
            metric.reset_state()
        self._backend.metrics_reset()

    # ------------------------------------------------------------------ whole passes
    def evaluate(self, x: Any, y: Any = None, batch_size: int | None = None,
                 sample_weight: Any = None) -> dict[str, float]:  # fmt: skip
        """The loss and metrics over every row of `x`, exactly (padding counts nowhere)."""
        self.reset_metrics()
        for batch in self.batches(x, y, batch_size, sample_weight=sample_weight, training=False):
            self.test_step(batch)
        return self.results()

    def predict(self, x: Any, batch_size: int | None = None):
        """The model's outputs for every row of `x`, in order, as numpy arrays."""
        batches = self.batches(x, None, batch_size, training=False)
        outputs, masks = [], []
        for b in batches:
            self._check_structure("predict", b)
            with self.accelerator.scope():
                out, mask = self._backend.predict_masked(b)
            outputs.append(keras.tree.map_structure(np.asarray, self._backend.to_host(out)))
            masks.append(np.asarray(self._backend.to_host(mask)))
        # Each batch's row mask says which of its rows are real: no length needed.
        keep = np.concatenate(masks).reshape(-1) > 0
        return keras.tree.map_structure(
            lambda *parts: np.concatenate(parts, axis=0)[keep], *outputs
        )

    # ------------------------------------------------------------------ callbacks
    def callbacks(self, callbacks: list, epochs: int, steps: int | None = None):
        """A `keras.callbacks.CallbackList` of `callbacks` for this loop's model, with
        Keras's `params` (`epochs`, `steps`) set, as `fit` would set them.

        Callbacks that read `model.optimizer` (LearningRateScheduler, BackupAndRestore) need
        the model compiled with this loop's optimizer. After `on_train_begin()`,
        `loop.initial_epoch` is the epoch a restored backup resumes at.
        """
        inner = inner_optimizer(self.optimizer)
        if getattr(self.model, "optimizer", None) not in (self.optimizer, inner):
            raise ValueError(
                "Callbacks read the optimizer from the model, but the model was not compiled "
                "with this loop's optimizer. Compile it first, `model.compile(optimizer=opt)` "
                "inside acc.scope(), and build the loop with it (acc.loop(model) takes the "
                f"compiled optimizer). Received: model.optimizer={self.model.optimizer!r}."
            )
        return _ScopedCallbacks(
            self.accelerator.scope,
            callbacks,
            add_history=False,
            model=self.model,
            epochs=epochs,
            steps=steps,
            verbose=0,
        )

    @property
    def initial_epoch(self) -> int:
        """Where training resumes: the epoch a `BackupAndRestore` restored, else 0."""
        return int(keras_internals.initial_epoch(self.model) or 0)


class _ScopedCallbacks(keras.callbacks.CallbackList):
    """Keras's CallbackList, each hook run in the Accelerator's scope, as `fit` runs them
    (a restore or a new learning-rate variable lands on the devices)."""

    def __init__(self, scope, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._scope = scope


def _scoped(name):
    def hook(self, *args, **kwargs):
        with self._scope():
            return getattr(keras.callbacks.CallbackList, name)(self, *args, **kwargs)

    hook.__name__ = name
    return hook


for _hook in (
    "on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end",
    "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end",
    "on_test_batch_begin", "on_test_batch_end", "on_predict_begin", "on_predict_end",
    "on_predict_batch_begin", "on_predict_batch_end",
):  # fmt: skip
    setattr(_ScopedCallbacks, _hook, _scoped(_hook))


def _check_placed(accelerator, optimizer) -> None:
    runtime = accelerator.runtime
    if runtime.native is None:
        return
    for variable in optimizer.variables:
        detail = runtime.variable_misplaced(variable)
        if detail is not None:
            raise RuntimeError(
                f"The optimizer was created outside `acc.scope()`: its variable "
                f"{variable.path!r} {detail}, but this Accelerator spreads work over "
                f"{accelerator.num_replicas} replicas. Create it inside `with acc.scope():`."
            )


def _optimizer(model, optimizer, accelerator):
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "Accelerator.loop needs an optimizer: pass optimizer=..., or compile the model "
            "with one. Received: optimizer=None and an uncompiled model."
        )
    optimizer = keras.optimizers.get(optimizer)
    policy = keras.config.dtype_policy()
    float16 = "mixed_float16" in (accelerator.dtype_policy, policy.name)
    if float16 and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        # float16 gradients underflow without loss scaling; bfloat16 needs none.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


def _loss(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None)
    if loss is None:
        raise ValueError(
            "Accelerator.loop needs a loss: pass loss=... (a keras.losses.Loss, or a function "
            "of (y_true, y_pred) returning one loss per example). Received: loss=None."
        )
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    if not callable(loss):
        raise TypeError(
            f"`loss` must be a keras.losses.Loss or a function of (y_true, y_pred). "
            f"Received: {loss!r} of type {type(loss).__name__}"
        )
    return loss


_BY_TARGETS = ("accuracy", "acc")


def _compiled_metrics(model) -> tuple[list, list]:
    """The `metrics=` and `weighted_metrics=` the model was compiled with, as flat lists."""
    found = []
    for given in keras_internals.compiled_metric_arguments(model):
        if given is None:
            given = []
        if isinstance(given, dict) or any(isinstance(m, (list, tuple, dict)) for m in given):
            raise ValueError(
                "acc.loop applies each metric to the model's whole output, but the model was "
                f"compiled with metrics per output: {given!r}. Pass metrics=[...] (and "
                "weighted_metrics=[...]) to acc.loop for the output the loop's loss reads."
            )
        found.append(list(given))
    return found[0], found[1]


def _metric_from_identifier(identifier):
    # As Keras's `compile` turns a name or a function into a metric.
    metric = keras.metrics.get(identifier)
    if not isinstance(metric, keras.metrics.Metric):
        name = identifier if isinstance(identifier, str) else getattr(metric, "__name__", None)
        metric = keras.metrics.MeanMetricWrapper(metric, name=name)
    return metric


def _accuracy(name: str, y_true, y_pred, loss):
    # Keras's rule (compile_utils.is_binary_or_sparse_categorical) for "accuracy"; where the
    # outputs cannot be described without running the model, the loss says which labels.
    if y_pred is None:
        losses = keras.losses
        by_loss = {
            losses.SparseCategoricalCrossentropy: keras.metrics.SparseCategoricalAccuracy,
            losses.BinaryCrossentropy: keras.metrics.BinaryAccuracy,
            losses.CategoricalCrossentropy: keras.metrics.CategoricalAccuracy,
        }
        for kind, metric in by_loss.items():
            if isinstance(loss, kind):
                return metric(name=name)
        raise ValueError(
            f"The model was compiled with {name!r}, which Keras resolves from the shapes of "
            "the targets and the outputs, and the outputs of this model could not be worked "
            f"out from its inputs. Pass metrics=[...] to acc.loop. Received: loss={loss!r}."
        )
    y_true, y_pred = keras.tree.flatten(y_true)[0], keras.tree.flatten(y_pred)[0]
    true_shape, pred_shape = tuple(np.shape(y_true)), tuple(y_pred.shape)
    if pred_shape[-1] == 1:
        return keras.metrics.BinaryAccuracy(name=name)
    if len(true_shape) < len(pred_shape) or (true_shape[-1] == 1 and pred_shape[-1] > 1):
        return keras.metrics.SparseCategoricalAccuracy(name=name)
    return keras.metrics.CategoricalAccuracy(name=name)


def _output_spec(model, x):
    """The model's output for a batch like `x`, symbolically (shapes and dtypes only)."""
    specs = keras.tree.map_structure(
        lambda a: keras.KerasTensor(np.shape(a), "string" if a.dtype.kind in "OUS" else a.dtype),
        x,
    )
    return model.compute_output_spec(specs)


def _metric(metric):
    if isinstance(metric, keras.metrics.Metric):
        return metric
    if metric in ("accuracy", "acc"):
        # compile() picks the accuracy from the labels' and predictions' shapes; a loop is
        # told which one: integer labels, one-hot labels, or one probability per row.
        raise ValueError(
            f"Which accuracy depends on the labels: pass "
            f"keras.metrics.SparseCategoricalAccuracy('accuracy') (integer labels), "
            f"CategoricalAccuracy (one-hot) or BinaryAccuracy. Received: {metric!r}."
        )
    return keras.metrics.get(metric)
