"""`Accelerator`: one Keras script, mapped onto JAX device meshes or tf.distribute strategies."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import keras

from keras_accel.adapter import backends, choice, fusion, inputs, layouts, placement
from keras_accel.adapter.batches import Batches
from keras_accel.adapter.feeder import Feeder
from keras_accel.adapter.guard import RecompileGuard
from keras_accel.adapter.layouts import LayoutReport
from keras_accel.adapter.run import Runner
from keras_accel.adapter.session import FunctionCache
from keras_accel.adapter.strategies import check_strategy_name, resolve
from keras_accel.data import sources
from keras_accel.data.batching import REMAINDER_POLICIES
from keras_accel.utils import cluster, process
from keras_accel.utils.checks import check_positive_int
from keras_accel.utils.seed import set_random_seed

MIXED_PRECISION = {
    None: None,
    "float32": "float32",
    "bfloat16": "mixed_bfloat16",
    "mixed_bfloat16": "mixed_bfloat16",
    "float16": "mixed_float16",
    "mixed_float16": "mixed_float16",
}


class Accelerator:
    """Runs a Keras model on every device there is, with one script for JAX and TensorFlow.

    The Accelerator picks (or is told) a strategy, builds the backend's distribution for it
    (`keras.distribution.DataParallel`/`ModelParallel` on JAX, a `tf.distribute` strategy on
    TensorFlow), and feeds `model.fit`, `evaluate` and `predict` batches of one static shape:
    the last, partial batch is padded with rows of sample weight 0, so nothing crashes on
    uneven batches, nothing recompiles, and padding never counts in losses, metrics or
    BatchNormalization statistics.

    Args:
        strategy: a name from `keras_accel.STRATEGIES`: "auto" (default), "single",
            "data_parallel", "mirrored", "model_parallel" (JAX), "fsdp" (JAX: every
            variable split over the devices), "tpu", or one registered with
            `keras_accel.STRATEGIES.register`.
        devices: None for every device of the chosen platform, an int for the first N, or a
            list of device names such as ["cpu:0", "cpu:1"].
        mesh_shape: (data, model) sizes for "model_parallel" (default: every device on
            the model axis) and "fsdp" (default: every device on the data axis).
        mixed_precision: None, "bfloat16" or "float16": the Keras dtype policy of models
            built inside `scope()`.
        seed: seeds Python, NumPy and the backend, so every process starts from the same
            weights and shuffles the same way.
        layout_map: a `keras.distribution.LayoutMap` for "model_parallel" or "fsdp" (JAX),
            or a keras-hub model class whose backbone ships one (e.g.
            `keras_hub.models.GemmaCausalLM`); by default Dense kernels are sharded over
            the "model" axis (where it has more than one device). On torch
            "model_parallel" needs a `LayoutMap`: its "model" axis spans the processes.
        remainder: what training does with the last, partial batch: "pad" (padded with
            zero-weight rows, exact) or "drop" (skipped; a new shuffle each epoch). The
            default, None, pads, except where the model's code cannot be told which rows
            are padding (a `train_step` or `compute_loss` of its own that reads no sample
            weights, `add_loss`, training without targets): then the last partial batch
            runs unpadded (numeric arrays, a generator or a PyDataset: on one replica, on
            JAX, over torch's processes and MirroredStrategy's replicas; a tf.data.Dataset:
            on one replica, on JAX in one process and over MirroredStrategy's replicas), and
            elsewhere is dropped, with a note.
        steps_per_execution: steps per host call in `fit`, `evaluate` and `predict`
            ("host-loop fusion", Keras's knob of that name). "auto" (default) runs up to 32
            steps per call where every callback can take it (see
            `keras_accel.adapter.fusion`), with results equal to one step per call; an int
            fixes it (1 turns fusion off). A model compiled with `steps_per_execution` > 1
            keeps its own.
        sync_batchnorm: True (default): BatchNormalization statistics are those of the
            global batch's real rows, on every replica, so training equals one-device
            training. On TensorFlow with several replicas that costs two all-reduces per
            layer and step (about 5% of a step of the seed MLP on 8 CPU replicas, where
            the default is within 8% of plain Keras: docs/benchmarks.md);
            False keeps each replica's statistics over its own real rows, as plain
            Keras does there (layers built with `synchronized=True` still
            synchronize). On JAX the program sees the global batch, so statistics are
            global either way, as in Keras.
        jit_compile: which of two ways with the same numbers runs a model's steps:
            TensorFlow on one device, a group of steps as one XLA program (True) or each
            step as the model compiles it (False: TensorFlow's graph, or an XLA launch per
            step under the model's `jit_compile=True`); torch, Keras's step compiled as one program
            (True) or eager (False); JAX, a group of steps as one scanned program
            (True) or a program call per step (False; compiled either way). "auto"
            (default) times both on the model itself and keeps the faster, remembered
            per model architecture, input signature and machine
            (`keras_accel.adapter.choice`). `KERAS_ACCEL_JIT_COMPILE=1|0` does the same
            for "auto", and on torch a model compiled with `jit_compile=True` keeps it.

    Example:
        >>> import keras, numpy as np
        >>> from keras_accel import Accelerator
        >>> acc = Accelerator(seed=0)
        >>> with acc.scope():
        ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        ...     model.compile(optimizer="adam", loss="mse")
        >>> x, y = np.ones((10, 4), "float32"), np.zeros((10, 2), "float32")
        >>> history = acc.fit(model, x, y, batch_size=8, epochs=1, verbose=0)
        >>> acc.predict(model, x, verbose=0).shape
        (10, 2)
    """

    def __init__(
        self,
        strategy: str = "auto",
        devices: int | list[str] | None = None,
        mesh_shape: tuple[int, int] | None = None,
        mixed_precision: str | None = None,
        seed: int | None = None,
        layout_map: Any = None,
        remainder: str | None = None,
        steps_per_execution: str | int = fusion.AUTO,
        sync_batchnorm: bool = True,
        jit_compile: str | bool = choice.AUTO,
    ):
        check_strategy_name(strategy)
        self.jit_compile = choice.check_setting(jit_compile)
        self.steps_per_execution = fusion.check(steps_per_execution)
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(
                "`sync_batchnorm` must be True (BatchNormalization statistics over the global "
                "batch, as on one device) or False (each replica's own, as plain Keras on "
                f"TensorFlow). Received: sync_batchnorm={sync_batchnorm!r}"
            )
        self._sync_batchnorm = sync_batchnorm
        if mixed_precision not in MIXED_PRECISION:
            valid = [k for k in MIXED_PRECISION if k]
            raise ValueError(
                f"Unknown mixed_precision. Received: mixed_precision={mixed_precision!r}. "
                f"Valid values: None, {', '.join(repr(v) for v in valid)}."
            )
        if remainder is not None and remainder not in REMAINDER_POLICIES:
            raise ValueError(
                f"`remainder` must be one of {REMAINDER_POLICIES}. "
                f"Received: remainder={remainder!r}"
            )
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise TypeError(f"`seed` must be an int or None. Received: seed={seed!r}")
        self._backend = keras.backend.backend()
        self._module = backends.load(self._backend)
        # A multi-process run joins its cluster before the first device query.
        self._cluster = cluster.detect(self._backend)
        connect = getattr(self._module, "connect", None)
        if connect is not None:
            connect(self._cluster)
        if self._cluster is not None:
            cluster.exit_on_uncaught_error()
        inventory = self._module.inventory(probe_tpu=strategy in ("auto", "tpu"))
        workers = None
        if self._backend == "tensorflow" and self._cluster is not None:
            workers = self._cluster.num_processes
        elif self._backend == "tensorflow" and strategy == "multi_worker":
            raise ValueError(
                "strategy='multi_worker' on TensorFlow needs TF_CONFIG naming every worker "
                "(MultiWorkerMirroredStrategy reads the cluster there); none was found. Start "
                "the script with `keras-accel launch -n N`, or set TF_CONFIG on each host."
            )
        self._plan = resolve(
            strategy, inventory, devices=devices, mesh_shape=mesh_shape, workers=workers
        )
        self._runtime = self._module.build(self._plan, layout_map)
        self._policy = MIXED_PRECISION[mixed_precision]
        self.seed = seed
        self.remainder = remainder
        self.guard = RecompileGuard()
        self._runner = Runner(
            self._runtime, self.guard, FunctionCache(), self.scope, self._sync_batchnorm
        )
        # The batch size fit last used per model: evaluate and predict default to it.
        self._batch_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        if self.num_processes > 1:
            # Every process must build the same weights and shuffle the same way: the
            # chief's seed (drawn there when none was given) is everyone's.
            seed = self.seed = self._module.agree_seed(seed)
        if seed is not None:
            set_random_seed(seed)

    # ------------------------------------------------------------------ facts
    @property
    def backend(self) -> str:
        """The Keras backend: "jax", "tensorflow" or "torch"."""
        return self._backend

    @property
    def strategy_name(self) -> str:
        """The resolved strategy ("auto" is never shown: it says what it picked)."""
        return self._plan.strategy

    @property
    def devices(self) -> list[str]:
        """The devices in use, e.g. ["cpu:0", ..., "cpu:7"]."""
        return list(self._plan.devices)

    @property
    def num_replicas(self) -> int:
        """How many copies of the model each global batch is split over."""
        return self._runtime.num_replicas

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return self._plan.mesh_shape

    @property
    def num_processes(self) -> int:
        return process.num_processes()

    @property
    def process_index(self) -> int:
        return process.process_index()

    @property
    def is_chief(self) -> bool:
        """True in the one process that writes files."""
        return process.is_chief()

    @property
    def distribution(self):
        """The backend object: a `keras.distribution.Distribution`, a `tf.distribute.Strategy`,
        or None for a single device."""
        return self._runtime.native

    @property
    def sync_batchnorm(self) -> bool:
        """Whether BatchNormalization statistics span the global batch (see the argument).
        Fixed for the Accelerator's life: the steps it compiles keep it."""
        return self._sync_batchnorm

    @property
    def dtype_policy(self) -> str | None:
        """The Keras dtype policy `scope()` sets ("mixed_float16", "mixed_bfloat16",
        "float32"), or None where `mixed_precision` was not given (Keras's own applies)."""
        return self._policy

    @property
    def num_recompiles(self) -> int:
        """New compilations (step traces) after warm-up; 0 is what static batching promises."""
        return self.guard.num_recompiles

    def __repr__(self) -> str:
        return (
            f"Accelerator(backend={self.backend!r}, strategy={self.strategy_name!r}, "
            f"devices={len(self.devices)} x {self._plan.platform}, "
            f"num_replicas={self.num_replicas}, num_processes={self.num_processes}, "
            f"process_index={self.process_index}, is_chief={self.is_chief})"
        )

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def scope(self):
        """Build and compile models in here: variables are laid out over the devices, and
        the mixed-precision policy applies to layers created inside."""
        previous = keras.config.dtype_policy()
        if self._policy is not None:
            keras.config.set_dtype_policy(self._policy)
        try:
            with self._runtime.scope():
                yield self
        finally:
            keras.config.set_dtype_policy(previous)

    # ------------------------------------------------------------------ batch sizes
    def global_batch_size(self, per_replica: int) -> int:
        """Rows per step over all replicas for `per_replica` rows on each replica."""
        check_positive_int("per_replica", per_replica)
        return per_replica * self.num_replicas

    def per_replica_batch_size(self, global_batch: int) -> int:
        """Rows each replica computes per step when a step takes `global_batch` rows."""
        check_positive_int("global_batch", global_batch)
        if global_batch % self.num_replicas:
            low = max(global_batch // self.num_replicas, 1) * self.num_replicas
            raise ValueError(
                f"global_batch={global_batch} does not split evenly over "
                f"{self.num_replicas} replicas. Use {low} or {low + self.num_replicas}."
            )
        return global_batch // self.num_replicas

    # ------------------------------------------------------------------ data
    def dataset(
        self,
        x: Any,
        y: Any = None,
        batch_size: int | None = None,
        shuffle: bool = False,
        sample_weight: Any = None,
        class_weight: dict | None = None,
        training: bool = True,
        remainder: str | None = None,
    ):
        """Static-shape batches that a plain `model.fit` (or `evaluate`, `predict`) accepts.

        Args:
            x, y, sample_weight, class_weight: as in `model.fit`. `x` may also be a
                `keras.utils.PyDataset` or a `tf.data.Dataset` (batched, yielding x,
                (x, y) or (x, y, sample_weight)); then `batch_size` must be None.
            batch_size: global rows per step (default 32 for arrays). Rounded up to a
                multiple of the replica count by padding when it does not split evenly.
            shuffle: reshuffle rows every epoch (arrays only).
            training: True weights padded batches for training (the loss is the mean over
                real rows); False weights every row so that evaluation is exact.
            remainder: overrides the Accelerator's training remainder policy.

        Returns:
            A `keras.utils.PyDataset` or a `tf.data.Dataset` of `(x, y, sample_weight)`
            batches (padding rows weighted 0), or `(x,)` when there are no targets; on
            TensorFlow under MultiWorkerMirroredStrategy, a Keras data adapter over this
            worker's rows of every batch, which `model.fit` takes as it is.
            BatchNormalization and the unweighted compiled `metrics=` see padding rows in a
            plain `model.fit`; `acc.fit` keeps them out of both.
        """
        remainder = remainder or self.remainder or "pad"
        batches = self.feeder.batches(
            x, y, batch_size, shuffle, sample_weight, class_weight, training, remainder
        )
        return self._runtime.wrap(batches, carry_mask=False)

    @property
    def feeder(self) -> Feeder:
        """What turns every input of this Accelerator's calls (and of `acc.loop`) into
        static batches (`keras_accel.adapter.feeder`)."""
        return Feeder(self._runtime, self.num_replicas, self.num_processes, self.seed)

    @property
    def runtime(self):
        """The backend runtime of this Accelerator (its strategy or distribution, the
        collectives, how batches reach the devices): what `acc.loop` builds on."""
        return self._runtime

    # ------------------------------------------------------------------ model
    def describe(self, model: keras.Model) -> LayoutReport:
        """Where each variable of `model` lies over this Accelerator's devices, read from
        the arrays themselves: a `LayoutReport`, one row per variable (the model's, its
        optimizer's, its metrics') with its path, shape, dtype, layout, and the block and
        bytes each device holds; `print()` it for a table with the totals per device.

        Under `strategy="fsdp"` a kernel reads `P(None, 'batch')` (its second dimension
        split over the data axis) and each device holds 1/N of it; under `data_parallel`
        every variable is "replicated" (JAX) or "mirrored" (TF). On torch it describes this
        process's whole copy, on its device (every process holds one). On JAX, optimizer
        slots exist once the optimizer is built (the first `fit`, or `optimizer.build`).

        Example:

        >>> import keras
        >>> from keras_accel import Accelerator
        >>> acc = Accelerator(strategy="single")
        >>> with acc.scope():
        ...     model = keras.Sequential(
        ...         [keras.Input((4,)), keras.layers.Dense(2, name="out")], name="net"
        ...     )
        >>> print(acc.describe(model))  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
        net under single on 1 device:
        variable        shape   dtype    layout  per device  bytes
        net/out/kernel  (4, 2)  float32  ...:0   (4, 2)       32 B
        net/out/bias    (2,)    float32  ...:0   (2,)          8 B
        per device: model 40 B of 40 B
        """
        placement.check_is_model(model)
        if not model.built:
            raise ValueError(
                f"Model {model.name!r} has no variables yet: build it first (give it a "
                "`keras.Input`, or call it on a batch), then describe it."
            )
        count = len(self.devices)
        where = f"{count} devices (mesh {self.mesh_shape})" if count > 1 else "1 device"
        title = f"{model.name} under {self.strategy_name} on {where}:"
        return layouts.describe(model, self._runtime.placement, title)

    def prepare(self, model: keras.Model) -> keras.Model:
        """Check that `model` can run on this Accelerator: a `keras.Model` built and compiled
        in `scope()`, and a Keras that has every internal keras_accel relies on. `fit`,
        `evaluate` and `predict` call this. It changes nothing on the model: what those
        calls install lasts exactly as long as they run.

        Where the scope lays variables out (several devices on JAX or TensorFlow), a model
        built or compiled outside it is an error naming it. On one device, and on torch
        (every process holds a whole copy on its own device, placed by Keras), the scope
        places nothing: a model built outside it is the same model and trains the same,
        except that `mixed_precision=` applies only to layers made inside."""
        placement.check(model, self._runtime, self.num_replicas)
        return model

    # ------------------------------------------------------------------ calls
    # Each call is told in order: the model checked, its inputs standardized and checked,
    # batched (padding exact, or the last batch dropped with a note, or refused), fused (steps
    # per host call), then wrapped and run in Keras's own call (`keras_accel.adapter.run`).

    def fit(
        self,
        model: keras.Model,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: list | None = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool = True,
        class_weight: dict | None = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
    ):
        """`model.fit` on every device, with static batches. Same arguments and return value
        (a `keras.callbacks.History`) as Keras."""
        placement.check(model, self._runtime, self.num_replicas)
        verbose = _chief_only(verbose)
        x, kind = inputs.standardize(model, x)
        inputs.check_text_targets(model, y, "y")
        if validation_split:
            (x, y, sample_weight), validation_data = inputs.split(
                x, y, sample_weight, validation_split, kind, validation_data
            )
        batches = self._batches()
        train = batches.training(
            model, x, y, batch_size, shuffle, sample_weight, class_weight, kind
        )
        self._batch_sizes[model] = train.plan.batch_size
        contracts = {"train": batches.contract(train)}
        val = None
        if validation_data is not None:
            vx, vy, vsw = inputs.validation_data(validation_data)
            vx, vkind = inputs.standardize(model, vx)
            inputs.check_text_targets(model, vy, "validation_data's y")
            vbatch = (validation_batch_size or batch_size) if vkind == sources.ARRAYS else None
            val = batches.evaluation(
                model, vx, vy, vbatch, vsw, vkind, "validation_data", "validation_data"
            )
            contracts["test"] = batches.contract(val)
        n = fusion.steps_per_call(
            self.steps_per_execution,
            self._runtime,
            model,
            "train",
            steps_per_epoch or train.plan.num_batches,
            callbacks,
            verbose,
            validating=val is not None,
            divides=validation_steps if val is not None else None,
            batches=train,
            validation=val,
        )
        return self._runner.fit(
            model,
            train,
            val,
            contracts,
            n,
            self.jit_compile,
            callbacks,
            verbose,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            validation_steps=validation_steps,
            validation_freq=validation_freq,
        )

    def evaluate(
        self,
        model: keras.Model,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: Any = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: list | None = None,
        return_dict: bool = False,
    ):
        """`model.evaluate` on every device. The loss and every metric equal the unpadded
        single-device result: padding rows carry weight 0, real rows a uniform weight.
        `batch_size` defaults to the one `fit` last used for this model (else 32)."""
        placement.check(model, self._runtime, self.num_replicas)
        verbose = _chief_only(verbose)
        x, kind = inputs.standardize(model, x)
        inputs.check_text_targets(model, y, "y")
        batch_size = _default_batch_size(self._batch_sizes.get(model), kind, batch_size)
        batches = self._batches()
        data = batches.evaluation(model, x, y, batch_size, sample_weight, kind, "x", "evaluate")
        n = fusion.steps_per_call(
            self.steps_per_execution,
            self._runtime,
            model,
            "test",
            steps or data.plan.num_batches,
            callbacks,
            verbose,
            batches=data,
        )
        return self._runner.evaluate(
            model,
            data,
            batches.contract(data),
            n,
            self.jit_compile,
            callbacks,
            verbose,
            steps=steps,
            return_dict=return_dict,
        )

    def predict(
        self,
        model: keras.Model,
        x: Any,
        batch_size: int | None = None,
        verbose: Any = "auto",
        steps: int | None = None,
        callbacks: list | None = None,
    ):
        """`model.predict` on every device: exactly one output row per input row, in order.
        `batch_size` defaults to the one `fit` last used for this model (else 32).

        Where several processes each read their own files of a tf.data pipeline
        (docs/multi_host.md), each global batch holds every process's next rows: the rows
        are all there once, in the order of the processes' batches, not the pipeline's."""
        placement.check(model, self._runtime, self.num_replicas)
        verbose = _chief_only(verbose)
        x, kind = inputs.standardize(model, x)
        batch_size = _default_batch_size(self._batch_sizes.get(model), kind, batch_size)
        data = self._batches().prediction(x, batch_size, kind)
        n = fusion.steps_per_call(
            self.steps_per_execution,
            self._runtime,
            model,
            "predict",
            steps or data.plan.num_batches,
            callbacks,
            verbose,
            batches=data,
        )
        return self._runner.predict(model, data, n, callbacks, verbose, steps=steps)

    def _batches(self) -> Batches:
        """What checks this call's batches, with the Accelerator's remainder policy now."""
        return Batches(self.feeder, self.remainder, self.num_replicas)

    # ------------------------------------------------------------------ custom loops
    def loop(
        self,
        model: keras.Model,
        optimizer: Any = None,
        loss: Any = None,
        metrics: list | None = None,
        weighted_metrics: list | None = None,
    ):
        """A custom training loop for `model`, the same on every backend and strategy.

        The user writes the loop over epochs and batches; keras_accel compiles the steps
        (JAX: `jax.jit` over the mesh; TensorFlow: `tf.function` around `strategy.run`),
        averages the loss over the global batch as `tf.nn.compute_average_loss` does, and
        reads the metrics across replicas. See `keras_accel.loop` and docs/custom_loop.md.

        Args:
            model: a model built in `scope()`.
            optimizer, loss, metrics: default to what the model was compiled with. `loss`
                is a `keras.losses.Loss` (used unreduced) or a function of
                `(y_true, y_pred)` returning one loss per example.
            weighted_metrics: metrics that also see the sample weights.

        Returns:
            A `keras_accel.loop.CustomLoop`.
        """
        from keras_accel.loop import CustomLoop

        return CustomLoop(self, model, optimizer, loss, metrics, weighted_metrics)


def _chief_only(verbose):
    """`verbose` in the chief process, 0 in the others, which would print the same progress
    bar and notes again, interleaved with the chief's (the chief alone logs, as it alone
    writes files)."""
    return verbose if process.is_chief() else 0


def _default_batch_size(fit_batch_size, kind: str, batch_size):
    """Evaluation and prediction default to the training batch size (`fit_batch_size`, the
    one fit last used for the model): the step programs are then compiled for one batch
    shape, instead of a second one for Keras's 32."""
    if batch_size is not None or kind != sources.ARRAYS:
        return batch_size
    return fit_batch_size
