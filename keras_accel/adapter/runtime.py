"""What every backend's runtime answers: the contract between the Accelerator's core and a
backend (`keras_accel.adapter.backends`), with the defaults of a backend that has nothing
to do at a step.

A runtime is built from a `Plan` by the backend's `build`, as the class the strategy
registry hands back for the (backend, strategy) pair, around the distribution object the
registry's builder made for it (`keras_accel.adapter.strategies.STRATEGIES`): `native` is
that `keras.distribution` Distribution, `tf.distribute` strategy or torch process group,
None on one device. Each backend has a base runtime (this class's subclass), and a strategy
that behaves otherwise subclasses that, in a module of its own, overriding only what
differs (`backends/tensorflow/multi_worker.py`, `backends/torch/data_parallel.py`).
"""

from __future__ import annotations

import contextlib

from keras import backend, ops

from keras_accel.adapter.layouts import Placement, itemsize
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.strategies import Plan


class Runtime:
    """One Accelerator's distribution on one backend.

    Attributes:
        plan: the `Plan` it was built from.
        native: the backend's distribution object, or None for one device.
        num_replicas: the data-parallel replicas (the mesh's data axis).
        all_reduce_sum: sums tensors across replicas inside a replica's step (what
            BatchNormalization's moments need), or None where the program already sees
            the global batch (JAX's global view, one device).
        max_steps_per_execution: the most steps one host call may run, or None (any):
            Keras's torch trainer runs one.
        summed_loss_factor: what a loss with `reduction="sum"` is multiplied by in each
            replica's program so that the gradients applied are the global batch's sum's
            (the replicas' gradients are averaged: torch's processes) and its mean over
            the replicas is the global sum; 1 where they are summed (TensorFlow) or the
            program sees the global batch (JAX).
    """

    all_reduce_sum = None
    summed_loss_factor = 1
    # The most steps one host call may run (Keras's `steps_per_execution`), or None.
    max_steps_per_execution: int | None = None

    def __init__(self, plan: Plan, native=None):
        self.plan = plan
        self.native = native
        self.num_replicas = plan.num_replicas

    @property
    def whole_remainder(self) -> str | None:
        """How a last partial batch reaches the model's code unpadded, where padding rows
        cannot be weighted out of it (`keras_accel.data.batching.PLAN_REMAINDERS`), or None
        where it cannot: "whole", a batch of its real rows through a step compiled for its
        shape, on one replica, where no batch needs to split. Where replicas each run their
        own program on a share of each batch it need not split evenly: torch's processes
        and a MirroredStrategy's replicas run it whole in each ("replicate"); where none
        of these can, the Accelerator drops or refuses it (`keras_accel.adapter.batches`)."""
        return "whole" if self.num_replicas == 1 else None

    @property
    def whole_stream_remainder(self) -> str | None:
        """`whole_remainder` for a data set read in Python as it comes (a generator, a
        `PyDataset`), whose batches reach the step through `keras_accel.data.pydataset`:
        each batch with padding is marked as it is padded (`StreamPlan.cut_of`). None where
        the runtime feeds such a stream another way."""
        return self.whole_remainder

    @property
    def whole_pipeline_remainder(self) -> str | None:
        """`whole_remainder` for a user's `tf.data.Dataset`, each batch padded in its graph
        (`keras_accel.data.tf_padding`): "whole" on one replica (nothing padded), else
        None where the runtime cannot take a batch marked in the graph (the default)."""
        return "whole" if self.num_replicas == 1 else None

    def device_scope(self):
        """The context that puts new variables on the plan's one device (`native` None)."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def scope(self):
        """Where models, optimizers and metrics are made: the strategy's scope, or the one
        device."""
        scope = self.device_scope() if self.native is None else self.native.scope()
        with scope:
            yield

    def model_misplaced(self, model) -> str | None:
        """Why `model` would not run under this runtime (None: it would)."""
        return None

    def variable_misplaced(self, variable) -> str | None:
        """Why `variable` was not made under this runtime (None: it was)."""
        return None

    def placement(self, variable) -> Placement:
        """Where `variable`'s array lies (`keras_accel.adapter.layouts`), read from the
        array itself. The default: whole, on one device."""
        value = variable.value
        return Placement(
            layout=self.plan.devices[0],
            per_device_shape=tuple(variable.shape),
            num_devices=1,
            # Keras's name of the array's dtype: torch's dtypes are not numpy's.
            itemsize=itemsize(backend.standardize_dtype(value.dtype)),
        )

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        """What this backend changes on `model` for one call, recorded in `patches`."""

    def install_outer(self, patches: Patches, model) -> None:
        """What must wrap the core's step wrappers (JAX: outputs gathered across
        processes)."""

    def callbacks(self) -> list:
        """Callbacks each Keras call runs beside the user's."""
        return []

    def make_function(self, model, kind: str):
        """The step function for `kind` where Keras's cannot run here; None: Keras's."""
        return None

    def replicated_function(self, model, kind: str):
        """`kind`'s step function for a call whose short last batch every replica runs whole
        (`whole_remainder` "replicate") where Keras's or `make_function`'s cannot feed it;
        None: those."""
        return None

    def reads_steps_per_execution(self, model, kind: str) -> bool:
        """Whether `kind`'s step function reads N > 1 at each call, so that one compiled
        function serves every N > 1 (False: N is compiled in)."""
        return False

    def fuses_predictions(self, model) -> bool:
        """Whether N predictions per host call run in one program of one shape, so that
        "auto" fusion takes `predict` too (JAX's on-device groups)."""
        return False

    def row_count(self, row_mask):
        """A batch's real rows, the weight of its loss in the epoch's average."""
        return ops.sum(row_mask)

    def own_files(self, batches):
        """This process's own files of a file-backed pipeline, or None (read it all)."""
        return None

    def own_rows(self, source, num_replicas: int, remainder: str, training: bool):
        """The feeder's batches of a Grain data set that every process reads only its own
        rows of (`keras_accel.data.grain.process_share`), or None (read it all)."""
        return None

    def grouped(self, batches, model, kind: str, steps_per_call: int, preprocess=None):
        """What `model.fit` (or `evaluate`) takes for the feeder's `batches` where this
        backend reads a whole call's steps at once, else None (`wrap`)."""
        return None

    @staticmethod
    def groups_arrays(
        batches, model, kind: str, steps_per_call: int, preprocess, compiled_only: bool = True
    ) -> bool:
        """Whether a call's steps can read `batches` a group at a time: in-memory numpy
        arrays of numbers (no text, nothing sparse) without preprocessing, N > 1 train or
        test steps, not run eagerly, of a model compiled with `jit_compile` where
        `compiled_only` (JAX: the step function that reads a whole group is a compiled
        one)."""
        return (
            kind in ("train", "test")
            and steps_per_call > 1
            and (bool(model.jit_compile) or not compiled_only)
            and not model.run_eagerly
            and Runtime.numeric_arrays(batches, preprocess)
        )

    @staticmethod
    def numeric_arrays(batches, preprocess=None, array_likes: bool = False) -> bool:
        """Whether `batches` are numpy arrays of numbers (no text, nothing sparse), read
        without preprocessing; with `array_likes`, array-likes on disk of numbers count too
        (`keras_accel.data.on_disk`)."""
        import numpy as np

        from keras_accel.data.batching import flatten
        from keras_accel.data.sources import ArrayBatches

        if not isinstance(batches, ArrayBatches) or preprocess is not None:
            return False
        arrays = flatten((batches.x, batches.y, batches.sample_weight))
        return all(
            (array_likes or isinstance(a, np.ndarray)) and np.dtype(a.dtype).kind in "biuf"
            for a in arrays
            if a is not None
        )

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        """What `model.fit` takes for the feeder's `batches`."""
        raise NotImplementedError(f"{type(self).__name__}.wrap")
