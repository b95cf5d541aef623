"""`Accelerator`: one Keras script, mapped onto JAX device meshes or tf.distribute strategies."""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
import weakref
from typing import Any

import keras
import numpy as np

from keras_accel.adapter import backends, callback_list, choice, fusion, layouts
from keras_accel.adapter.exactness import inexact_under_padding
from keras_accel.adapter.feeder import Feeder, user_stacklevel
from keras_accel.adapter.guard import RecompileGuard
from keras_accel.adapter.layouts import LayoutReport
from keras_accel.adapter.pipeline import is_pipeline, preprocessor, with_made_targets
from keras_accel.adapter.session import FunctionCache, Session
from keras_accel.adapter.steps import (
    StepContract,
    honours_sample_weight,
    overrides,
    overrides_any_step,
)
from keras_accel.adapter.strategies import check_strategy_name, resolve
from keras_accel.data import on_disk, sources
from keras_accel.data.batching import REMAINDER_POLICIES, flatten, map_structure, unpack
from keras_accel.utils import cluster, keras_internals, process
from keras_accel.utils.checks import check_positive_int
from keras_accel.utils.optimizers import inner_optimizer
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
            the "model" axis (where it has more than one device).
        remainder: what training does with the last, partial batch: "pad" (padded with
            zero-weight rows, exact) or "drop" (skipped; a new shuffle each epoch). The
            default, None, pads, except where the step cannot be told which rows are
            padding (a model that overrides `train_step` and gets no sample weights, or
            training without targets): then the last partial batch is dropped, with a note.
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
        self._functions = FunctionCache()
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
        _check_positive_int(per_replica, "per_replica")
        return per_replica * self.num_replicas

    def per_replica_batch_size(self, global_batch: int) -> int:
        """Rows each replica computes per step when a step takes `global_batch` rows."""
        _check_positive_int(global_batch, "global_batch")
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

    def _training_batches(
        self, model, x, y, batch_size, shuffle, sample_weight, class_weight, kind=None
    ):
        """The training batches, with the remainder policy for steps that cannot be told
        which rows are padding: without targets nothing weights padding out of a loss, and a
        model's own `train_step` without the user's weights gets `(x, y)`, as in Keras."""

        def make(remainder):
            batches = self.feeder.batches(
                x, y, batch_size, shuffle, sample_weight, class_weight, True, remainder, True, kind
            )
            return with_made_targets(batches, preprocessor(model))

        batches = make(self.remainder or "pad")
        builtin = not overrides(model, "train")
        if builtin and not batches.has_targets and keras_internals.compile_loss(model):
            raise ValueError(
                f"{type(model).__name__} was compiled with a loss, which needs targets, but "
                "fit got none. Received: y=None. Pass y (or a data set that yields (x, y)), "
                "or compile without `loss=` if the model adds its own losses (add_loss)."
            )
        # A step of the user's is given padding rows (weighted 0) if it honours weights.
        custom = not builtin and not batches.weighted and not honours_sample_weight(model)
        blind = not batches.has_targets or custom
        if not blind and batches.plan.pads and builtin:
            return self._exact_training(model, batches, make)
        if not blind or not batches.plan.pads:
            return batches
        plan = batches.plan
        reason = (
            "there are no targets to weight padding rows out of the loss"
            if not batches.has_targets
            else f"{type(model).__name__} overrides train_step and gets (x, y) batches"
        )
        if self.remainder is None and plan.static_rows == plan.batch_size:
            return _dropped(
                make,
                plan,
                f"{reason}, so the last partial batch",
                "Pass Accelerator(remainder='pad') to feed it padded, weighted 0 in "
                "sample_weight, or a batch_size that divides the data.",
            )
        if self.remainder == "pad" and batches.has_targets:
            return batches  # Asked for: padding reaches the step as sample_weight 0.
        raise ValueError(
            f"keras_accel: {reason}, but {plan.describe()} over {self.num_replicas} replicas "
            f"{'need' if plan.num_samples is not None else 'may need'} padding rows in "
            f"{'every batch' if plan.static_rows != plan.batch_size else 'the last batch'}. "
            f"Use a batch_size that is a multiple of {self.num_replicas}"
            + (" (the last partial batch is then dropped)" if batches.has_targets else "")
            + (
                ", or Accelerator(remainder='pad') to pass padding rows to the step with "
                "sample_weight 0 (the step must honour sample_weight)."
                if batches.has_targets
                else "; and pass y, or remainder='drop'."
            )
        )

    def _exact_training(self, model, batches, make):
        """Padded training batches, unless a loss or metric of the user's cannot weight the
        padding rows out (`keras_accel.adapter.exactness`): then the last partial batch is
        dropped with a note, where dropping it removes all padding, or the fit is refused."""
        found = inexact_under_padding(model, sources.sample_batch(batches))
        if not found:
            return batches
        plan = batches.plan
        if self.remainder is None and plan.static_rows == plan.batch_size:
            return _dropped(
                make,
                plan,
                f"{'; '.join(found)}, so padding rows would change it: the last partial batch",
                "Every batch is then exact. Honour sample_weight (or return one loss per "
                "row) to keep it.",
            )
        raise ValueError(_inexact_message(found, plan, self.num_replicas, "training"))

    def _check_exact(self, model, batches, name: str) -> None:
        """Evaluation must see every row: a loss or metric that padding would make inexact
        is refused, naming it (see `keras_accel.adapter.exactness`)."""
        if not batches.plan.pads or not batches.has_targets or overrides(model, "test"):
            return
        found = inexact_under_padding(model, sources.sample_batch(batches))
        if found:
            raise ValueError(_inexact_message(found, batches.plan, self.num_replicas, f"`{name}`"))

    def _contract(self, batches) -> StepContract:
        plan = batches.plan
        if plan.static_rows != plan.batch_size:
            padding = f", each padded to {plan.static_rows} rows for {self.num_replicas} replicas"
        else:
            padding = f" over {self.num_replicas} replica(s)"
        return StepContract(
            pass_weights=batches.has_targets and (batches.weighted or plan.pads),
            user_weighted=batches.weighted,
            padded=plan.pads,
            description=f"{plan.describe()}{padding}",
        )

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
        _check_is_model(model)
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
        _check_is_model(model)
        keras_internals.check_model(model)
        runtime = self._runtime
        if runtime.native is None:
            return model
        where = "`with acc.scope():` so its variables are laid out over the devices"
        name = f"{type(model).__name__} {model.name!r}"
        detail = runtime.model_misplaced(model)
        if detail is not None:
            raise RuntimeError(
                f"The model was built outside `acc.scope()`: {detail}, but this Accelerator "
                f"spreads work over {self.num_replicas} replicas. Build and compile {name} "
                f"inside {where}."
            )
        for stage, variables in _variables_by_stage(model):
            for variable in variables:
                detail = runtime.variable_misplaced(variable)
                if detail is not None:
                    raise RuntimeError(
                        f"The model was {stage} outside `acc.scope()`: its variable "
                        f"{variable.path!r} {detail}, but this Accelerator spreads work over "
                        f"{self.num_replicas} replicas. "
                        + (
                            f"Compile {name} (again) inside "
                            if stage == "compiled"
                            else f"Build and compile {name} inside "
                        )
                        + f"{where}."
                    )
        for metric in _compiled_metric_objects(model):
            for variable in metric.variables:
                detail = runtime.variable_misplaced(variable)
                if detail is not None:
                    raise RuntimeError(
                        f"The metric {metric.name!r} given to compile() was created outside "
                        f"`acc.scope()`: its variable {variable.path!r} {detail}, but this "
                        f"Accelerator spreads work over {self.num_replicas} replicas. Create "
                        f"it inside `with acc.scope():`, or pass its name to compile()."
                    )
        return model

    def _session(self, model, contracts, data, batches, first_contract, patch=None) -> Session:
        first = (
            None
            if first_contract is None
            else functools.partial(_first_batch, data, batches, first_contract, model)
        )
        return Session(
            model,
            contracts,
            self._runtime,
            self.guard.record,
            self._functions,
            first_batch=first,
            patch=patch,
            sync_batchnorm=self._sync_batchnorm,
        )

    def _own_callbacks(self) -> list:
        """The runtime's callbacks for a Keras call (none on most runs)."""
        return self._runtime.callbacks()

    def _with_own(self, callbacks):
        """The user's callbacks and the runtime's; the user's own object where none."""
        own = self._own_callbacks()
        if not own:
            return callbacks
        if isinstance(callbacks, keras.callbacks.CallbackList):
            raise TypeError(
                "Pass callbacks as a list: a keras.callbacks.CallbackList cannot take the "
                "callback that keeps batch ends on the main thread across processes. "
                f"Received: callbacks={callbacks!r}"
            )
        return [*(callbacks or []), *own]

    def _call_callbacks(self, model, callbacks, data, verbose, steps):
        """The callbacks Keras's `evaluate` or `predict` gets: the user's and the runtime's,
        our progress bar where Keras would add its own, in our CallbackList where `data` is
        one of our adapters (`callback_list.for_call`)."""
        callbacks = fusion.progress(self._with_own(callbacks), verbose)
        return callback_list.for_call(model, callbacks, data, verbose=verbose, steps=steps)

    def _fuse(
        self,
        model,
        kind: str,
        steps,
        callbacks,
        verbose,
        validating=False,
        divides=None,
        batches=None,
    ) -> int:
        n, why = fusion.choose(
            self.steps_per_execution,
            model,
            kind,
            steps,
            callbacks,
            validating=validating,
            fuse_predictions=self._runtime.fuses_predictions(model),
            batch_bytes=getattr(batches, "batch_bytes", None),
        )
        chosen = why.startswith(("compile(", "Accelerator("))
        limit = self._runtime.max_steps_per_execution
        if limit is not None and n > limit:
            if why.startswith("Accelerator("):
                raise ValueError(
                    f"Keras's {self._backend} trainer runs at most {limit} step per call. "
                    f"Received: Accelerator(steps_per_execution={n}). Use "
                    "steps_per_execution='auto' (or 1) on this backend."
                )
            if not chosen:  # compile()'s own value: Keras says what it takes.
                n, why = limit, f"auto: Keras's {self._backend} trainer runs one step per call"
        if divides and not chosen and n > 1 and divides % n:
            # Keras validates with fit's steps_per_execution: a group of N steps must not
            # read past `validation_steps`.
            n = math.gcd(n, int(divides))
            why = f"{why}; dividing validation_steps={divides}"
        fusion.note(model, n, why, 1 if verbose == "auto" else verbose)
        return n

    def _wrap(self, model, kind: str, batches, n: int, preprocess, steps):
        """`batches` as the model's `kind` steps take them: one group of `n` batches per call
        where the backend reads a call's steps at once (`Runtime.grouped`) and the call's
        epochs are whole passes (`steps` None), else batch by batch (`Runtime.wrap`)."""
        if steps is None:
            grouped = self._runtime.grouped(batches, model, kind, n, preprocess)
            if grouped is not None:
                return grouped
        return self._runtime.wrap(batches, True, preprocess)

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
        self.prepare(model)
        verbose = _chief_only(verbose)
        kind = sources.classify(x)  # Once: the feeder takes it as it is (`sources.classify`).
        x = _standardize_inputs(model, x, kind)
        _check_text_targets(model, y, "y")
        if validation_split:
            if validation_data is not None:
                raise ValueError(
                    "Pass either validation_split or validation_data, not both. Received: "
                    f"validation_split={validation_split} and validation_data."
                )
            (x, y, sample_weight), validation_data = _split(
                x, y, sample_weight, validation_split, kind
            )
        train = self._training_batches(
            model, x, y, batch_size, shuffle, sample_weight, class_weight, kind
        )
        self._batch_sizes[model] = train.plan.batch_size
        val = None
        if validation_data is not None:
            vx, vy, vsw = _unpack(validation_data)
            vkind = sources.classify(vx)
            vx = _standardize_inputs(model, vx, vkind)
            _check_text_targets(model, vy, "validation_data's y")
            vbatch = (validation_batch_size or batch_size) if vkind == sources.ARRAYS else None
            val = self.feeder.batches(vx, vy, vbatch, False, vsw, None, False, None, True, vkind)
            val = with_made_targets(val, preprocessor(model))
            _check_evaluation(val, "validation_data")
            self._check_exact(model, val, "validation_data")
        preprocess = preprocessor(model)
        steps = steps_per_epoch or train.plan.num_batches
        n = self._fuse(
            model,
            "train",
            steps,
            callbacks,
            verbose,
            validating=val is not None,
            divides=validation_steps if val is not None else None,
            batches=train,
        )
        # The call's steps where its epochs are whole passes of known length: what a
        # compiled way would save (`choice`).
        known = steps if steps_per_epoch is None and steps else None
        epochs_left = int(epochs) - int(initial_epoch)
        call_steps = {
            "train": None if known is None else epochs_left * int(known),
            "test": _validation_steps(val, validation_steps, epochs_left, validation_freq),
        }
        with choice.in_call(model, call_steps, _printing(verbose), self.jit_compile):
            train_data = self._wrap(model, "train", train, n, preprocess, steps_per_epoch)
            contracts = {"train": self._contract(train)}
            if val is not None:
                contracts["test"] = self._contract(val)
            # A Grain data set's epochs end where a pass ends (keras_accel.data.grain).
            sync = _EpochSync(
                self.guard,
                train,
                keras_ends_epochs=isinstance(train_data, keras.utils.PyDataset)
                or getattr(train_data, "keras_accel_ends_epochs", False),
            )

            def patch(patches):
                _bind_schedule(model, epochs, steps, patches, train.plan)
                fusion.install(
                    patches, model, n, callbacks, kind="train", epochs=int(epochs), steps=steps
                )

            with (
                self.scope(),
                self._session(model, contracts, train_data, train, contracts["train"], patch),
            ):
                return _keras(model, "fit")(
                    train_data,
                    epochs=epochs,
                    verbose=verbose,
                    # Rows are shuffled per epoch by our batches; Keras must keep their order.
                    shuffle=False,
                    callbacks=callback_list.for_call(
                        model,
                        fusion.progress(
                            [sync, *(callbacks or []), *self._own_callbacks()], verbose
                        ),
                        train_data,
                        verbose=verbose,
                        epochs=epochs,
                        steps=steps_per_epoch,
                        history=True,
                    ),
                    validation_data=None
                    if val is None
                    else self._wrap(model, "test", val, n, preprocess, validation_steps),
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
        self.prepare(model)
        verbose = _chief_only(verbose)
        kind = sources.classify(x)
        x = _standardize_inputs(model, x, kind)
        _check_text_targets(model, y, "y")
        batch_size = self._default_batch_size(model, kind, batch_size)
        batches = self.feeder.batches(
            x, y, batch_size, False, sample_weight, None, False, None, True, kind
        )
        batches = with_made_targets(batches, preprocessor(model))
        _check_evaluation(batches, "x")
        self._check_exact(model, batches, "evaluate")
        contract = self._contract(batches)
        length = steps or batches.plan.num_batches
        n = self._fuse(model, "test", length, callbacks, verbose, batches=batches)
        patch = functools.partial(
            fusion.install, model=model, n=n, callbacks=callbacks, kind="test", steps=length
        )
        with choice.in_call(
            model, {"test": None if steps else length}, _printing(verbose), self.jit_compile
        ):
            data = self._wrap(model, "test", batches, n, preprocessor(model), steps)
            with (
                self.scope(),
                self._session(model, {"test": contract}, data, batches, contract, patch),
            ):
                result = _keras(model, "evaluate")(
                    data,
                    verbose=verbose,
                    steps=steps,
                    callbacks=self._call_callbacks(model, callbacks, data, verbose, steps),
                    return_dict=return_dict,
                )
        self.guard.mark_warm(model, "test")
        return result

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
        self.prepare(model)
        verbose = _chief_only(verbose)
        kind = sources.classify(x)
        x = _standardize_inputs(model, x, kind)
        batch_size = self._default_batch_size(model, kind, batch_size)
        batches = self.feeder.batches(
            x, None, batch_size, False, None, None, False, None, True, kind
        )
        data = self._runtime.wrap(batches, True, preprocessor(model))
        contracts = {"predict": StepContract(pass_weights=False)}
        length = steps or batches.plan.num_batches
        n = self._fuse(model, "predict", length, callbacks, verbose, batches=batches)
        patch = functools.partial(
            fusion.install, model=model, n=n, callbacks=callbacks, kind="predict", steps=length
        )
        # The model's step sees `(x,)`, as Keras's own: nothing to build it from for us.
        with self.scope(), self._session(model, contracts, data, batches, None, patch):
            outputs, row_mask = _keras(model, "predict")(
                data,
                verbose=verbose,
                steps=steps,
                callbacks=self._call_callbacks(model, callbacks, data, verbose, steps),
            )
        self.guard.mark_warm(model, "predict")
        # Each batch's row mask came back beside its outputs: keep the real rows.
        keep = np.asarray(row_mask).reshape(-1) > 0
        return keras.tree.map_structure(lambda a: np.asarray(a)[keep], outputs)

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

    def _default_batch_size(self, model, kind: str, batch_size):
        """Evaluation and prediction default to the training batch size: the step programs
        are then compiled for one batch shape, instead of a second one for Keras's 32."""
        if batch_size is not None or kind != sources.ARRAYS:
            return batch_size
        return self._batch_sizes.get(model)


def _keras(model, name: str):
    """The Keras method to call: the model's own, except for a keras-hub pipeline model,
    whose fit/evaluate/predict would preprocess our batches a second time: we preprocess
    (see `keras_accel.adapter.pipeline`) and call Keras's."""
    if is_pipeline(model):
        return functools.partial(getattr(keras.Model, name), model)
    return getattr(model, name)


def _validation_steps(val, validation_steps, epochs: int, validation_freq) -> int | None:
    """The validation steps a `fit` of `epochs` epochs runs (None: unknown or none)."""
    per_pass = None if val is None else validation_steps or val.plan.num_batches
    if not per_pass or not isinstance(validation_freq, int) or validation_freq < 1:
        return None
    return (epochs // validation_freq) * int(per_pass)


def _printing(verbose) -> bool:
    """Whether a call's one-line notes print (Keras's "auto" prints)."""
    return bool(1 if verbose == "auto" else verbose)


def _chief_only(verbose):
    """`verbose` in the chief process, 0 in the others, which would print the same progress
    bar and notes again, interleaved with the chief's (the chief alone logs, as it alone
    writes files)."""
    return verbose if process.is_chief() else 0


def _standardize_inputs(model, x, kind: str):
    """Array inputs as numpy; and `[x]` or `(x,)` for a model with one input is `x`, as
    Keras's functional models read it (a one-element list of inputs would otherwise be a
    structure of its own)."""
    if x is None or kind != sources.ARRAYS:
        return x
    x = sources.to_numpy(x, "x")
    if isinstance(x, (list, tuple)) and len(x) == 1 and sources.is_array_input(x[0]):
        inputs = getattr(model, "inputs", None)
        try:
            single = inputs is not None and len(inputs) == 1
        except (TypeError, ValueError, AttributeError):
            single = False
        if single and hasattr(x[0], "shape"):
            return x[0]
    return x


def _dropped(make, plan, what: str, advice: str):
    """Training batches without the last partial batch, with a one-line note saying why
    (`what` ends in "the last partial batch") and how to keep it."""
    dropped = make("drop")
    if plan.num_samples is None:  # A stream: a partial batch is known only when it comes.
        detail = f"of {plan.describe()}, if it has one,"
    else:
        rows = plan.num_samples - dropped.plan.rows_seen
        detail = f"({rows} of {plan.num_samples} rows, a new draw every epoch when shuffling)"
    warnings.warn(
        f"keras_accel: {what} {detail} is dropped (remainder='drop'). {advice}",
        stacklevel=user_stacklevel(),
    )
    return dropped


def _inexact_message(found: list[str], plan, num_replicas: int, what: str) -> str:
    return (
        f"keras_accel: {'; '.join(found)}, and {what} pads its batches ({plan.describe()} "
        f"over {num_replicas} replicas), so the result "
        "would count padding rows, where plain Keras is exact. Make the loss return one "
        "value per row and the metric honour sample_weight, or use a batch_size that is a "
        f"multiple of {num_replicas} and divides the number of rows, so that nothing is padded."
    )


def _check_evaluation(batches, name: str) -> None:
    if not batches.has_targets and batches.plan.pads:
        plan = batches.plan
        raise ValueError(
            f"Without targets, padding rows cannot be weighted out of an evaluation, but "
            f"`{name}` is {plan.describe()}, which "
            f"{'need' if plan.num_samples is not None else 'may need'} padding over the "
            "replicas. Pass targets, or a batch_size that divides the number of rows and is "
            "a multiple of the replica count (for a tf.data.Dataset, "
            "`batch(n, drop_remainder=True)` with such an n)."
        )


def _first_batch(data, batches, contract: StepContract, model=None):
    """The first batch of `data` as the model's step sees it (arrays, or tf.data tensors),
    for Keras's symbolic build; text is described as a "string" tensor, which Keras reads
    where numpy's `str`/`object` dtypes are refused."""
    data = getattr(data, "keras_accel_local", data)  # A worker's share of distributed data.
    if hasattr(data, "keras_accel_first_batch"):  # A stream of passes (Grain, own files).
        x, y, sample_weight, _ = data.keras_accel_first_batch()
    elif isinstance(data, keras.utils.PyDataset):
        x, y, sample_weight, _ = unpack(data[0])
    elif sources.is_generator(data):  # A stream: its first batch was kept aside.
        x, y, sample_weight, _ = batches.first_batch()
    else:  # A tf.data.Dataset.
        x, y, sample_weight, _ = unpack(next(iter(data.take(1))))
    if model is not None:
        _check_text_targets(model, y, "the first batch's y")
    x, y, sample_weight = keras.tree.map_structure(_symbolic_text, (x, y, sample_weight))
    if y is None:
        return (x,)
    if not contract.user_weighted:
        # Only the row mask, shaped in the step by each loss's rank (`_weighted`): building
        # needs no weights, and a row's weight of shape (rows,) cannot meet a loss with one
        # value per time step.
        sample_weight = None
    return (x, y, sample_weight) if contract.pass_weights else (x, y)


def _check_text_targets(model, y, where: str) -> None:
    """Targets must be numbers for a compiled loss: text targets would otherwise fail inside
    the model's build with the backend's own words (JAX's "data type 'string' not
    understood", torch's `KeyError: 'string'`, TF's "Cast string to float"). A step of the
    user's may read text itself, and a keras-hub preprocessor maps its own targets."""
    if y is None or overrides_any_step(model) or preprocessor(model) is not None:
        return
    leaves = keras.tree.flatten(y)
    for leaf in leaves:
        dtype = getattr(leaf, "dtype", None)
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "OUS":
            if leaf.dtype.kind == "O" and not any(isinstance(v, (str, bytes)) for v in leaf.flat):
                continue
            shown = str(leaf.dtype)
        elif getattr(dtype, "name", None) == "string":  # A tf.string tensor.
            shown = "string"
        elif isinstance(leaf, (str, bytes)):  # A list of labels.
            shown, leaf = type(leaf).__name__, leaves
        else:
            continue
        first = np.asarray(leaf).reshape(-1)[:3].tolist()
        raise ValueError(
            f"The targets are text, which the loss of {type(model).__name__} {model.name!r} "
            f"cannot compare with its predictions. Received: {where} of dtype {shown} "
            f"(first values {first}). Map the labels to integers before training: a "
            "`keras.layers.StringLookup(num_oov_indices=0)` adapted to them, on the arrays "
            "(`y = lookup(y)`) or in the data pipeline (`ds.map(lambda x, y: (x, lookup(y)))`), "
            "or `np.unique(y, return_inverse=True)[1]`."
        )


def _symbolic_text(leaf):
    if isinstance(leaf, np.ndarray) and leaf.dtype.kind in "OUS":
        return keras.KerasTensor(leaf.shape, "string")
    return leaf


def _check_is_model(model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(f"Expected a keras.Model. Received: {type(model).__name__}")


def _variables_by_stage(model):
    """The model's variables by when they are made: building (layers) and compiling (the
    optimizer's, the metrics')."""
    yield "built", model.weights
    state = []
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        state += list(optimizer.variables)
    for metric in model.metrics:
        state += list(metric.variables)
    yield "compiled", state


def _compiled_metric_objects(model) -> list:
    """The Metric objects given to `compile(metrics=..., weighted_metrics=...)`, which Keras
    keeps as they are (their variables exist before the first step)."""
    given = keras_internals.compiled_metric_arguments(model)
    return [m for m in keras.tree.flatten(given) if isinstance(m, keras.metrics.Metric)]


def _bind_schedule(model, epochs: int, steps_per_epoch: int | None, patches, plan) -> None:
    """A keras_accel schedule given to the optimizer without the training length
    (`WarmupCosine(warmup_fraction=...)`) gets this fit's, for this fit."""
    optimizer = getattr(model, "optimizer", None)
    inner = inner_optimizer(optimizer)
    schedule = None if inner is None else keras_internals.learning_rate_of(inner)
    if getattr(schedule, "needs_total_steps", False):
        if steps_per_epoch is None:
            raise ValueError(
                f"The optimizer's learning-rate schedule {type(schedule).__name__} is given "
                f"as a fraction of training, which needs the number of steps, but fit got "
                f"{plan.describe()}, whose length is unknown. Pass steps_per_epoch to fit, "
                "or give the schedule its total steps."
            )
        bound = schedule.with_total_steps(
            int(epochs) * steps_per_epoch, steps_per_epoch=steps_per_epoch
        )
        keras_internals.patch_learning_rate_of(patches, inner, bound)


class _EpochSync(keras.callbacks.Callback):
    """Keeps the training batches on Keras's epoch index (so the shuffle order of epoch k is
    the same in a resumed run), and ends the recompile guard's warm-up after the first epoch
    and its validation."""

    def __init__(self, guard: RecompileGuard, batches, keras_ends_epochs: bool):
        super().__init__()
        self.guard = guard
        self.batches = batches
        self.keras_ends_epochs = keras_ends_epochs

    def on_epoch_begin(self, epoch, logs=None):
        if hasattr(self.batches, "epoch"):
            self.batches.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        # Keras calls a PyDataset's on_epoch_end itself; a tf.data pipeline needs us to.
        if not self.keras_ends_epochs and hasattr(self.batches, "on_epoch_end"):
            self.batches.on_epoch_end()
        self.guard.mark_warm(self.model, "train")
        if logs and any(key.startswith("val_") for key in logs):
            self.guard.mark_warm(self.model, "test")


def _real_rows(plan) -> slice | np.ndarray:
    """Positions of real rows in the concatenated padded outputs."""
    rows, static = plan.real_rows, plan.static_rows
    if (rows[:-1] == static).all():
        return slice(0, int(rows.sum()))
    return np.concatenate([np.arange(i * static, i * static + r) for i, r in enumerate(rows)])


def _check_positive_int(value, name: str) -> None:
    check_positive_int(name, value)


def _unpack(data):
    if isinstance(data, (tuple, list)):
        # Keras's forms: (x,) (a model that makes its own targets), (x, y), (x, y, w).
        if len(data) not in (1, 2, 3):
            raise ValueError(
                "validation_data must be (x,), (x, y), (x, y, sample_weight) or a data set. "
                f"Received a tuple of {len(data)} elements."
            )
        return (*data, None, None)[:3]
    return data, None, None


def _split(x, y, sample_weight, fraction: float, kind: str):
    if kind != sources.ARRAYS:
        raise ValueError(
            "validation_split works on arrays only (as in Keras). Received x of type "
            f"{type(x).__name__}; pass validation_data instead."
        )
    if not 0.0 < fraction < 1.0:
        raise ValueError(
            f"validation_split must be in (0, 1). Received: validation_split={fraction}"
        )
    total = next(int(np.shape(a)[0]) for a in flatten(x) if a is not None)
    cut = int(total * (1.0 - fraction))  # Keras takes the *last* fraction, before shuffling.
    # Views, read with the batches: numpy slices (of a memory map too), and row ranges of
    # an array-like on disk, which slicing would read whole (`on_disk.rows_of`).
    head = lambda a: on_disk.rows_of(a, 0, cut)  # noqa: E731
    tail = lambda a: on_disk.rows_of(a, cut, total)  # noqa: E731
    sw = sample_weight
    if sw is not None and not on_disk.on_disk(sw):
        sw = np.asarray(sw)
    return (
        (map_structure(head, x), map_structure(head, y), None if sw is None else head(sw)),
        (map_structure(tail, x), map_structure(tail, y), None if sw is None else tail(sw)),
    )
