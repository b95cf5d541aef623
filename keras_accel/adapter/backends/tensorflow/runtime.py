"""The TensorFlow base runtime: one device or a `MirroredStrategy` from the registry
(`single`, `data_parallel`, `mirrored`), what one call changes under it, and the
distributed data sets its replicas read.

The other strategies subclass it, one module each, registered beside their builders
(`keras_accel.adapter.strategies.STRATEGIES.runtime`): `multi_worker` (each worker's rows
of every batch, and the workers' own files) and `tpu` (Keras distributes the pipeline).
What they change is a method each (`wrap`, `fed`, `distribute`, ...), not a test of the
strategy's name."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_accel.adapter import runtime
from keras_accel.adapter.backends.global_rows import FirstReplicaCounts
from keras_accel.adapter.backends.tensorflow import checks, replicated, xla
from keras_accel.adapter.backends.tensorflow.fused import fits_group_bytes, fused_function
from keras_accel.adapter.backends.tensorflow.gradients import install_summed_gradients
from keras_accel.adapter.backends.tensorflow.losses import (
    gradients_summed,
    install_uniform_losses,
    runs_as_one_device,
)
from keras_accel.adapter.backends.tensorflow.reduction import (
    all_reduce_sum,
    global_result,
    install_gathered_metrics,
    sum_undifferentiated,
)
from keras_accel.adapter.backends.tensorflow.rows import install_global_row_draws
from keras_accel.adapter.backends.tensorflow.strategies import tf_device_name
from keras_accel.adapter.layouts import Placement
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import install_global_results, overrides_any_step
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.batching import StreamPlan, element, flatten
from keras_accel.data.groups import GROUP_DATA, GROUP_REAL, GROUP_ROWS, GROUP_STEPS, RowGroups
from keras_accel.data.pydataset import StaticBatchDataset, stream
from keras_accel.data.sources import ArrayBatches, IterableBatches, refuse_preprocessing
from keras_accel.utils import keras_internals, library_internals


@STRATEGIES.runtime("single", "tensorflow", default=True)
@STRATEGIES.runtime("data_parallel", "tensorflow", default=True)
@STRATEGIES.runtime("mirrored", "tensorflow", default=True)
class Runtime(runtime.Runtime):
    """A `tf.distribute.MirroredStrategy` (or one device) built from a `Plan`; the base of
    every TensorFlow strategy's runtime.

    Attributes:
        spans_workers: whether the strategy's replicas span several workers, each holding
            only its own replicas' rows (`multi_worker`: a prediction's outputs are
            gathered across them, `keras_accel.loop.backends.tensorflow`).
    """

    spans_workers = False

    def __init__(self, plan: Plan, native):
        super().__init__(plan, native)
        # BatchNormalization sums its moments across replicas (see adapter.batchnorm).
        self.all_reduce_sum = all_reduce_sum if self.num_replicas > 1 else None

    @property
    def whole_remainder(self) -> str | None:
        """One replica: "whole". Several replicas of one worker: "replicate", every replica
        running the short batch whole (`replicated`). The TPU's and several workers'
        runtimes: None (their programs' shapes, their workers' own pipelines: not built)."""
        return "whole" if self.num_replicas == 1 else "replicate"

    @property
    def whole_stream_remainder(self) -> str | None:
        """One replica: "whole" (Keras's generator route takes batches of any size). Several
        replicas of one worker: "replicate", the stream read on the host and each batch
        handed to the replicas as it comes, one with padding whole in every replica
        (`replicated.HostStream`). The TPU's and several workers' runtimes: None (as
        `whole_remainder`)."""
        return self.whole_remainder

    @property
    def whole_pipeline_remainder(self) -> str | None:
        """As `whole_stream_remainder`: a user's tf.data pipeline, padded and marked in its
        graph, read on the host a batch per step over several replicas (`wrap`)."""
        return self.whole_remainder

    def replicated_function(self, model, kind: str):
        if self.native is None or kind == "predict":
            return None
        regular = fused_function(model, kind)
        return replicated.replicated_function(model, kind, regular)

    @staticmethod
    def local_devices(native) -> int | None:
        """The devices of this process that `native` (the builder's strategy) computes on,
        which must be the plan's (`strategies.check_built`); None: not read."""
        return len(native.extended.worker_devices)

    def device_scope(self):
        return tf.device(tf_device_name(self.plan.devices[0]))

    def scope(self):
        checks.check_not_nested(self.native)
        return super().scope()

    def model_misplaced(self, model) -> str | None:
        """Why `model` would not run under this runtime's strategy, or None."""
        checks.check_not_nested(self.native)  # Else the advice below leads back into the scope.
        strategy = keras_internals.distribute_strategy_of(model)
        if strategy is self.native:
            return None
        # Keras trains such a model on one device without a word.
        owner = "no strategy" if strategy is None else f"another {type(strategy).__name__}"
        return f"it belongs to {owner}"

    def variable_misplaced(self, variable) -> str | None:
        """Why `variable` was not created under this runtime's strategy, or None."""
        strategy = getattr(variable.value, "distribute_strategy", None)
        if strategy is self.native:
            return None
        return "is a plain variable" if strategy is None else "belongs to another strategy"

    def placement(self, variable) -> Placement:
        """Where `variable`'s tf.Variable lies: "mirrored" (a whole copy on each replica's
        device) under a strategy, else the one device it is on."""
        value = variable.value
        components = getattr(value, "values", None)  # A distributed variable's copies.
        if isinstance(components, (tuple, list)) and len(components) > 1:
            layout, count = "mirrored", len(components)
        else:
            spec = tf.DeviceSpec.from_string(value.device or "")
            kind = (spec.device_type or "cpu").lower()
            layout, count = f"{kind}:{spec.device_index or 0}", 1
        return Placement(
            layout=layout,
            per_device_shape=tuple(variable.shape),
            num_devices=count,
            itemsize=value.dtype.size,
        )

    def make_function(self, model, kind: str):
        """Keras's step function for `kind`, or ours where Keras's cannot run: N > 1 fused
        train or test steps, and every train or test step of a multi-worker strategy, whose
        logs Keras 3 fails to reduce (see `fused_function`, `reduction.reduce_logs`). None:
        Keras makes its own."""
        if not self.reads_steps_per_execution(model, kind):
            return None
        return fused_function(model, kind)

    def reads_steps_per_execution(self, model, kind: str) -> bool:
        """Whether `kind`'s step function is ours, which reads N at each call, so that one
        function serves every N; Keras's own TF function compiles N in."""
        if kind == "predict" or model.run_eagerly:
            return False
        return int(getattr(model, "steps_per_execution", 1) or 1) > 1

    def install(self, patches: Patches, model, first_batch, training: bool) -> None:
        if self.num_replicas > 1 and self._on_cpus():
            xla.without_xla(patches, model)
        if first_batch is not None and (self.native is not None or training):
            # Keras builds a model from the first batch it reads (under a strategy, reduced
            # across replicas with MEAN first, which fails for strings and booleans: raw
            # text, keras-hub padding masks). Ours carries the row mask, which only our step
            # wrappers understand: build from the batch the model's step sees instead. On
            # one device Keras builds nothing before its first step (the compiled metrics
            # are made in its trace); a fit builds them first here, as on JAX and torch, so
            # that a backup restored as the fit begins gives them their totals (a fresh
            # model resumed mid-epoch reports the whole epoch's metrics).
            keras_internals.install_symbolic_build(
                patches,
                model,
                first_batch,
                overrides_a_step=overrides_any_step(model),
                # One device: a model Keras could not build so is left to its first step.
                deferrable=self.native is None,
            )
            keras_internals.replace_tf_symbolic_build(patches, model)
        if self.num_replicas > 1:
            one_device = runs_as_one_device(model)
            if training:
                checks.check_optimizers_built(model)
                for optimizer in checks.optimizers(model):
                    checks.check_gradient_accumulation(optimizer, self.num_replicas)
                install_summed_gradients(
                    patches, checks.optimizers(model), lambda: gradients_summed(one_device)
                )
            # Dropout and the like (in training) and random layers of the user's (at every
            # call) draw one device's numbers for the global batch.
            install_global_row_draws(patches, model)
            install_uniform_losses(patches, model, one_device)
            install_global_results(patches, model, global_result)
            # Users' metrics (any state, a running maximum) on the global batch.
            install_gathered_metrics(patches, model)
            # Keras's metrics in a replicated step: the first replica's rows count once.
            FirstReplicaCounts(replicated.first_replica).install_on_model(patches, model)

    def row_count(self, row_mask):
        # Each replica weights its share of the epoch's loss average by the global batch's
        # real rows over the replica count: summed over replicas, the real rows.
        (total,) = sum_undifferentiated([tf.reduce_sum(tf.cast(row_mask, tf.float32))])
        return total / self.num_replicas

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        from keras_accel.data import tfdata

        replicate = getattr(batches.plan, "remainder", None) == "replicate"
        if replicate and not isinstance(batches.plan, StreamPlan):
            # The pipeline's batches, then the short one whole in every replica.
            # (All of them padded, so that the pipeline is one of any row count; the last
            # one is not taken. The untaken pipeline is what the model is built from.)
            full = batches.plan.num_batches - 1
            pipeline = tfdata.array_pipeline(
                replicated.padded_batches(batches), carry_mask, preprocess
            )
            distributed = self.distribute(pipeline.take(full), batches.plan.static_rows)
            distributed.tail = (full, replicated.tail_of(batches), self.native)
            return DistributedBatches(distributed, pipeline, num_batches=batches.plan.num_batches)

        if self.native is None and carry_mask and self.numeric_arrays(batches, preprocess):
            return HostBatches(batches)  # One device: no pipeline to build at each call.
        if _read_from_host(batches, preprocess):
            # Arrays on disk: read a batch at a time on the host, never made tensors whole
            # (an array pipeline holds its arrays whole as host tensors).
            if self.native is None and carry_mask and self.numeric_arrays(batches, None, True):
                return HostBatches(batches)
            return self.keras_route(StaticBatchDataset(batches, carry_mask=carry_mask), carry_mask)
        if isinstance(batches, tfdata.TFDatasetBatches) and replicate and carry_mask:
            # A user's pipeline whose batches with padding run whole in every replica: padded
            # and marked in its graph, read on the host a batch per step, as a stream is.
            pipeline = self.pipeline(batches, carry_mask, preprocess)
            host = replicated.HostStream(lambda: iter(pipeline), self.native)
            return DistributedBatches(host, pipeline, num_batches=batches.plan.num_batches)
        if isinstance(batches, (ArrayBatches, tfdata.TFDatasetBatches)):
            return self.fed(self.pipeline(batches, carry_mask, preprocess), batches, carry_mask)
        if isinstance(batches, IterableBatches):
            refuse_preprocessing(batches, preprocess)
            source = stream(batches, carry_mask=carry_mask)
        else:
            # A user's PyDataset: Keras's own route (tf.data from a generator).
            source = StaticBatchDataset(batches, carry_mask=carry_mask)
        if replicate and self.native is not None and carry_mask:
            # Its batches with padding run whole in every replica: read on the host.
            return HostStreamAdapter(source, self.native)
        return self.keras_route(source, carry_mask)

    @staticmethod
    def pipeline(batches, carry_mask: bool, preprocess):
        """In-memory arrays or a tf.data source as one tf.data pipeline of global batches."""
        from keras_accel.data import tfdata

        if isinstance(batches, ArrayBatches):
            return tfdata.array_pipeline(batches, carry_mask, preprocess)
        return batches.pipeline(carry_mask, preprocess)

    def fed(self, pipeline, batches, carry_mask: bool):
        """A pipeline of global batches as Keras's trainer takes it under this runtime: as
        it is on one device (Keras feeds it) and for `Accelerator.dataset` (a
        tf.data.Dataset, as it says), else split over the replicas (`distribute`)."""
        if self.native is None or not carry_mask:
            return pipeline
        distributed = self.distribute(pipeline, batches.plan.static_rows)
        return DistributedBatches(distributed, pipeline, num_batches=batches.plan.num_batches)

    def grouped(self, batches, model, kind: str, steps_per_call: int, preprocess=None):
        """In-memory `batches` as one element per fused call (`GroupedBatches`), where the
        call is one program (`fused.GroupRunner`: one device, train or test steps, N > 1,
        numbers within its byte limit), else None: `wrap` then gives the batches one by
        one.

        A group is gathered on the host from the arrays when its call comes, in one `take`
        per array, and handed to the program whole: read one by one through an iterator,
        each batch is an op of its own outside the program, which cost more than the steps
        of a small model (measured on 2 CPU cores, a 2-layer MLP at batch 64: 32 reads 1.3
        ms against 0.7 ms for the 32 steps with XLA), and a tf.data pipeline of groups
        took 60 ms to build at each call."""
        if not self._groups(batches, model, kind, steps_per_call, preprocess):
            return None
        return GroupedBatches(batches, steps_per_call)

    def _groups(self, batches, model, kind: str, steps_per_call: int, preprocess) -> bool:
        if _read_from_host(batches, preprocess):
            # The program would hold the arrays whole (`tfdata.host_arrays`): arrays on disk
            # are read by `wrap`'s batches instead, from the host, a group stacked per call
            # (`fused.GroupRunner.run_batches`).
            return False
        if self.native is not None or not self.groups_arrays(
            batches, model, kind, steps_per_call, preprocess, compiled_only=False
        ):
            return False
        # A group's bytes: its batches, the weights and the row mask as float32.
        static = batches.plan.static_rows
        weights = batches.sample_weight
        row = sum(a.itemsize * a[:1].size for a in flatten((batches.x, batches.y)) if a is not None)
        row += 4 * (1 if weights is None else weights[:1].size) + 4
        return fits_group_bytes(steps_per_call * static * row)

    def _on_cpus(self) -> bool:
        return all(name.lower().startswith("cpu") for name in self.plan.devices)

    def keras_route(self, source, carry_mask: bool):
        """A generator or a PyDataset of ours as Keras's trainer takes it: as it is where
        Keras distributes it (`Accelerator.dataset`: as it says), else through Keras's own
        adapter with our per-device data sets (`KerasRouteAdapter`)."""
        if self.native is None or not carry_mask:
            return source
        return KerasRouteAdapter(source, self.native)

    def distribute(self, pipeline, static_rows: int, own: bool = False):
        """Global batches of `static_rows` rows as the strategy's distributed data set, each
        replica getting its slice of each (the same batches on every replica: same order,
        same padding; `own`: the pipeline holds this worker's rows only, under
        `multi_worker`).

        MirroredStrategy's own `experimental_distribute_dataset` splits each batch the same
        way, but first serializes and clones the pipeline's graph for the workers' devices;
        an in-memory array pipeline holds the arrays in its graph, so that copied them (a
        CIFAR-10-sized training set cost 190 MiB more at the peak than this, 8 replicas)."""
        return self.replica_slices(pipeline)

    def replica_slices(self, mine):
        """`mine` (this worker's rows of each global batch) as the strategy's distributed
        data set, each batch cut into its local replicas' slices."""
        from keras_accel.data import tfdata

        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        local = len(self.native.extended.worker_devices)
        slices = tfdata.replica_slices(mine, local).with_options(options)
        return Distributed(self.native.distribute_datasets_from_function(lambda context: slices))


def _read_from_host(batches, preprocess) -> bool:
    """Whether `batches` are arrays on disk (`ArrayBatches.on_disk`: a memory map, an
    array-like), read batch by batch on the host; a model's own preprocessing runs in an
    array pipeline (tf.data) still, over the arrays whole."""
    return isinstance(batches, ArrayBatches) and batches.on_disk and preprocess is None


class Distributed(tf.distribute.DistributedDataset):
    """A strategy's distributed data set whose iterators stop when they are deleted.

    Each device of a `MirroredStrategy` reads its replica's slices through a data set of its
    own that TensorFlow builds when an iterator is made, with tf.data's default options, so
    with an autotuning thread each. Once a `tf.function` has read such an iterator, deleting
    it waits for those threads' next tuning period (which doubles, up to a minute) instead of
    stopping them, one device after another: measured on TensorFlow 2.21 with 8 CPU
    replicas, 10 to 70 s for an iterator read for 10 s. Keras's trainer makes each epoch's
    iterator anew and drops the last one as the next epoch's first step begins, so every
    epoch after the first, and `fit`'s return, paid that idle wait, under plain `model.fit`
    as well (docs/benchmarks.md). A device's data set only passes on the host's batches
    (with a prefetch of one); there is nothing to tune there, so ours have no such thread.
    The user's pipeline keeps its own options, autotuning included.

    An iterator is made when first read, not when Keras asks for it. Keras's TF epoch
    iterator asks at each epoch's start and again at its end, for the next epoch, which
    asks anew and drops that one unread (and so does the call's end); with 8 CPU replicas
    making one cost about 0.5 s (tracing each device's reader functions), and an epoch of
    2 steps with validation made 4 where it reads 2: 11 such epochs took 34 s, 12 s made
    when read (the same numbers). Made at the first read, it is made where Keras reads it,
    after the epoch's `on_epoch_begin` (a shuffled epoch's order is set there)."""

    # (full batches, the short batch's reader, the strategy): an epoch's iterator is a
    # `replicated.TailIterator` (the pipeline's batches, then that one whole in every replica).
    tail = None

    def __init__(self, dataset):
        self.dataset = dataset
        self._kind = None  # The class of the first iterator made: the later ones' class.

    def __iter__(self):
        if self._kind is None:
            first = self._make()
            self._kind = type(first)
        else:
            first = library_internals.tf_iterator_made_when_read(self._make, self._kind)
        if self.tail is not None:
            return replicated.TailIterator(first, *self.tail)
        return first

    def _make(self):
        with library_internals.tf_device_datasets_without_autotune():
            return iter(self.dataset)

    @property
    def element_spec(self):
        return self.dataset.element_spec

    def reduce(self, initial_state, reduce_func):
        return self.dataset.reduce(initial_state, reduce_func)

    def __getattr__(self, name):
        if name in ("dataset", "_kind", "tail"):  # Not set yet: no recursion.
            raise AttributeError(name)
        return getattr(self.dataset, name)


class KerasRouteAdapter(PaddedBatchesAdapter):
    """A `PyDataset` or a generator of ours on Keras's own route under a `MirroredStrategy`:
    Keras's adapter for it (`keras_internals.get_data_adapter`: its tf.data pipeline from the
    generator, its epochs, its reads ahead), whose pipeline is distributed as Keras's TF
    trainer distributes it (`experimental_distribute_dataset`), as a `Distributed`, so that
    the epoch boundaries do not idle. Keras's TF epoch iterator takes a
    `tf.distribute.DistributedDataset` as it is.

    `keras_accel_local` is the source, what the model is built from
    (`keras_accel.adapter.inputs.first_batch`)."""

    feeds = "TensorFlow's trainer"
    # Its batch count is Keras's adapter's, made inside Keras's call: our CallbackList
    # (which would ask before) leaves these calls to Keras's own (`callback_list.for_call`).
    counts_lazily = True

    def __init__(self, source, strategy):
        self.keras_accel_local = source
        # Keras's PyDataset adapter ends each epoch of the PyDataset, so of our batches.
        self.keras_accel_ends_epochs = isinstance(source, keras.utils.PyDataset)
        self.strategy = strategy
        self._adapter = None
        self._distributed = None
        self._in_epoch = False

    @property
    def keras_accel_indexed_batches(self):
        # Our PyDataset (`StaticBatchDataset`), read by Keras's adapter by position: it can
        # begin an epoch late.
        return getattr(self.keras_accel_local, "batches", None)

    @property
    def adapter(self):
        # Made at Keras's first question, inside its call, as Keras makes its own: a
        # generator's adapter reads its first batches when made.
        if self._adapter is None:
            # Our batches are in their epoch's order already: Keras must keep it.
            make = keras_internals.get_data_adapter()
            self._adapter = make(self.keras_accel_local, shuffle=False)
        return self._adapter

    def get_tf_dataset(self):
        if self._distributed is None:  # Once, as Keras's TF epoch iterator asks once.
            pipeline = _owned(self.adapter.get_tf_dataset())
            distributed = self.strategy.experimental_distribute_dataset(pipeline)
            self._distributed = Distributed(distributed)
        return self._distributed

    def get_numpy_iterator(self):
        return self.adapter.get_numpy_iterator()

    def on_epoch_begin(self):
        if self._in_epoch:
            # An epoch begun late (a resume) ends by Keras's `stop_training` where its data
            # ends, before Keras ends its adapter's epoch: ended here, as Keras would have.
            self.adapter.on_epoch_end()
        self._in_epoch = True
        self.adapter.on_epoch_begin()

    def on_epoch_end(self):
        self._in_epoch = False
        self.adapter.on_epoch_end()

    @property
    def num_batches(self):
        return self.adapter.num_batches

    @property
    def batch_size(self):
        return self.adapter.batch_size


class HostStreamAdapter(KerasRouteAdapter):
    """A generator or a PyDataset of ours whose batches with padding every replica runs
    whole (`remainder="replicate"`): Keras's adapter for it still (its epochs, its first
    batches), read on the host a batch at a time (`replicated.HostStream`), not through a
    `tf.distribute` pipeline, which would split the short batch over the replicas. Its step
    function is `replicated.replicated_function`, one step per call."""

    def get_tf_dataset(self):
        if self._distributed is None:
            self._distributed = replicated.HostStream(
                self.adapter.get_numpy_iterator, self.strategy
            )
        return self._distributed


class GroupedBatches(PaddedBatchesAdapter):
    """Groups of padded batches as Keras's TF trainer reads them: its epochs count
    `num_batches` steps, N per call, and our fused function runs one group per call
    (`fused.GroupRunner.run_group`), gathering its rows from the arrays, which it holds
    whole as host tensors (`tfdata.host_arrays`, made once per call), at the positions
    `keras_accel.data.groups.RowGroups` gives."""

    feeds = "TensorFlow's trainer"

    def __init__(self, batches, steps: int):
        from keras_accel.data import tfdata

        self.batches = batches
        self._groups = _Groups(RowGroups(batches, steps), tfdata.host_arrays(batches), steps)

    def get_tf_dataset(self):
        return self._groups

    @property
    def num_batches(self):
        return self.batches.plan.num_batches

    def keras_accel_first_batch(self):
        # What `Accelerator` builds the model from (`inputs.first_batch`): the first batch, as
        # numpy (the same dtypes: numbers only here).
        return self.batches.batch(0)


class HostBatches(PaddedBatchesAdapter):
    """In-memory arrays read on one device batch by batch as Keras's TF trainer asks, each
    padded batch gathered from the arrays when its step comes (`ArrayBatches.batch`, with
    the row mask): no tf.data pipeline, which cost 60 to 90 ms to build and 40 ms an
    iterator at every call (a `predict` of 32 small batches took 0.3 s, plain Keras's
    too). Keras's trainer runs a step per element of a Python iterator, our fused
    function too (`fused.fused_function`)."""

    feeds = "TensorFlow's trainer"

    def __init__(self, batches):
        self.batches = batches
        self._passes = _HostPasses(batches)

    def get_tf_dataset(self):
        return self._passes

    @property
    def keras_accel_indexed_batches(self):
        # Read by position in the epoch (`_HostPasses`): they can begin it late.
        return self.batches

    @property
    def num_batches(self):
        return self.batches.plan.num_batches

    def keras_accel_first_batch(self):
        return self.batches.batch(0)


class _HostPasses(tf.distribute.DistributedDataset):
    """A pass over the batches of the epoch they are in at each step (Keras takes a
    `DistributedDataset` as it is, and makes an iterator of it each epoch)."""

    def __init__(self, batches):
        self.batches = batches
        self._spec = None

    def __iter__(self):
        return (element(self.batches.batch(i), True, None) for i in range(len(self.batches)))

    @property
    def element_spec(self):
        if self._spec is None:
            first = element(self.batches.batch(0), True, None)
            self._spec = tf.nest.map_structure(
                lambda a: tf.TensorSpec(a.shape, tf.as_dtype(a.dtype)), first
            )
        return self._spec


class _Groups(tf.distribute.DistributedDataset):
    """What Keras's TF epoch iterator iterates, each epoch (and again at each epoch's end):
    the one reader of the call's groups (Keras takes a `DistributedDataset` as it is). Each
    element is a `RowGroups` element and the arrays (`GROUP_DATA`)."""

    def __init__(self, rows, arrays, steps: int):
        self.rows, self.arrays, self.steps = rows, arrays, steps

    def __iter__(self):
        return self

    def __next__(self):
        group = next(self.rows)
        group[GROUP_DATA] = self.arrays
        return group

    @property
    def element_spec(self):
        """What `fused.is_group` reads: an element's keys, its arrays' specs."""
        return {
            GROUP_STEPS: tf.TensorSpec((), tf.int32),
            GROUP_ROWS: tf.TensorSpec((None,), tf.int64),
            GROUP_REAL: tf.TensorSpec((self.steps,), tf.int32),
            GROUP_DATA: tf.nest.map_structure(
                lambda t: None if t is None else tf.TensorSpec.from_tensor(t), self.arrays
            ),
        }


def _owned(pipeline):
    """`pipeline` with every tensor copied into memory of its own.

    Keras's generator and PyDataset adapters read their numpy batches through
    `tf.data.Dataset.from_generator`, which makes an array whose data is 64-byte aligned a
    tensor over the array's own memory, not a copy. The step's ops may then write their
    results into that buffer (TensorFlow reuses an input's buffer that nothing else holds):
    over 2 replicas with fused steps, mean squared error wrote (pred - y)**2 into the rows of
    the user's y that replica 0 read (measured on TensorFlow 2.21; whether an array is
    aligned is up to the allocator, hence about half the runs): the user's arrays changed,
    and whatever read them next (a later epoch, plain Keras) read other values. Here every
    batch is the step's own: one copy of each, on the host, before it is split."""

    def copy(value):
        return tf.raw_ops.DeepCopy(x=value) if isinstance(value, tf.Tensor) else value

    if type(pipeline.element_spec) is tuple:  # tf.data passes a plain tuple's parts apart.
        return pipeline.map(lambda *parts: tf.nest.map_structure(copy, parts))
    return pipeline.map(lambda element: tf.nest.map_structure(copy, element))


class DistributedBatches(PaddedBatchesAdapter):
    """A distributed data set of ours as Keras's TF trainer reads it: a Keras `DataAdapter`
    (Keras's TF epoch iterator takes a `DistributedDataset` as it is) whose length is in
    global batches. The distributed data set's own cardinality counts its replicas'
    slices, one element each.

    `keras_accel_local` is the undistributed pipeline, what the model is built from
    (`keras_accel.adapter.inputs.first_batch`)."""

    feeds = "TensorFlow's trainer"

    def __init__(self, distributed, local, num_batches: int | None):
        self.distributed = distributed
        self.keras_accel_local = local
        self._num_batches = num_batches

    def get_tf_dataset(self):
        return self.distributed

    @property
    def keras_accel_indexed_batches(self):
        # An array pipeline that can begin an epoch late (`tfdata.array_pipeline`), or None;
        # not under remainder="replicate", whose short last batch is served apart (`tail`).
        if getattr(self.distributed, "tail", None) is not None:
            return None
        return getattr(self.keras_accel_local, "keras_accel_starts_late", None)

    @property
    def num_batches(self):
        return self._num_batches
