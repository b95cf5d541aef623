"""The custom loop itself: `CustomLoop`, a model with its optimizer, loss and metrics, and
the backend's compiled steps (`keras_accel.loop.backends`) behind one interface: batches,
train/test/predict steps, results, whole passes and Keras callbacks."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import keras
import numpy as np

from keras_accel.loop import arguments
from keras_accel.loop.batches import LoopBatches, StepGroup
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer


class CustomLoop:
    """A model, its optimizer, loss and metrics, and compiled train/test/predict steps.

    Built by `Accelerator.loop`; see the package docstring (`keras_accel.loop`) for an
    example and the guarantees. `optimizer`, `loss` and `metrics` default to what the
    model was compiled with. Metrics are Keras `Metric` objects (or names, as in
    `compile`); the loss tracker is named "loss".
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
            self.optimizer = arguments.get_optimizer(model, optimizer, accelerator)
            arguments.check_placed(accelerator, self.optimizer)
            if not self.optimizer.built:
                # Here, in the scope, not lazily inside a compiled (replicated) step.
                self.optimizer.build(model.trainable_variables)
            self.loss = arguments.get_loss(model, loss)
            self.loss_tracker = keras.metrics.Mean(name="loss")
            # Metrics named as `compile` names them ("accuracy") are resolved from the first
            # batch's targets and the model's outputs, as Keras resolves them (`batches()`).
            self._unresolved: list[tuple[str, bool]] = []
            if metrics is None and weighted_metrics is None:
                metrics, weighted_metrics = arguments.compiled_metrics(model)
                self.metrics = self._from_compile(metrics, weighted=False)
                self.weighted_metrics = self._from_compile(weighted_metrics, weighted=True)
            else:
                self.metrics = [arguments.get_metric(m) for m in (metrics or [])]
                self.weighted_metrics = [arguments.get_metric(m) for m in (weighted_metrics or [])]
        backend = keras.backend.backend()
        if backend not in ("jax", "tensorflow", "torch"):
            raise NotImplementedError(
                f"Accelerator.loop runs on JAX, TensorFlow and torch. Received: "
                f"KERAS_BACKEND={backend!r}."
            )
        module = importlib.import_module(f"keras_accel.loop.backends.{backend}")
        self._backend = module.Steps(self)
        self._structure = {}

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
        return LoopBatches(self, batches, training, epoch, n, self._backend)

    def _from_compile(self, metrics: list, weighted: bool) -> list:
        """Fresh metrics for the ones the model was compiled with: the loop's own state,
        never the state `fit` reports."""
        out = []
        for metric in metrics:
            if isinstance(metric, str) and metric.lower() in arguments.BY_TARGETS:
                self._unresolved.append((metric, weighted))
            elif isinstance(metric, keras.metrics.Metric):
                out.append(type(metric).from_config(metric.get_config()))
            else:
                out.append(arguments.metric_from_identifier(metric))
        return out

    def _resolve(self, batches) -> None:
        from keras_accel.data.sources import sample_batch

        x, y, _, _ = sample_batch(batches)
        try:
            y_pred = arguments.output_spec(self.model, x)
        except Exception:  # Raw inputs a preprocessor turns into the model's (keras-hub).
            y_pred = None
        with self.accelerator.scope():
            for name, weighted in self._unresolved:
                metric = arguments.accuracy_for(name, y, y_pred, self.loss)
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
    @property
    def traces(self) -> dict[str, int]:
        """How many times each step kind ("train", "test", "predict") has been traced
        (compiled) so far: once each where every batch has the same static shape."""
        return dict(self._backend.traces)

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
