"""The `multi_worker` strategy on TensorFlow: `MultiWorkerMirroredStrategy` over every
worker of a TF_CONFIG cluster (what `auto` picks there), its builder and its runtime.

Every worker reads the same global batches (same order, same padding) and keeps its rows
of each, which its replicas split; or, where every worker can, reads only its own files of
a file-backed pipeline. Every train and test step is ours (`fused.fused_function`), whose
logs are reduced across workers, and a prediction's outputs are gathered across them.
"""

from __future__ import annotations

from keras_accel.adapter.backends.tensorflow import cluster
from keras_accel.adapter.backends.tensorflow.runtime import DistributedBatches, Runtime
from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.data.sources import ArrayBatches


@STRATEGIES.builder("multi_worker", "tensorflow", default=True)
def _multi_worker(plan: Plan, layout_map):
    strategy = cluster.multi_worker()
    if strategy is None:
        raise RuntimeError(
            "strategy='multi_worker' on TensorFlow needs the cluster joined first (the "
            "Accelerator does it from TF_CONFIG); no MultiWorkerMirroredStrategy exists in "
            "this process."
        )
    if strategy.num_replicas_in_sync != plan.num_replicas:
        raise RuntimeError(
            f"MultiWorkerMirroredStrategy has {strategy.num_replicas_in_sync} "
            f"replicas where {plan.num_replicas} were planned ({plan.devices} per "
            "worker): every worker must see the same devices."
        )
    return strategy


@STRATEGIES.runtime("multi_worker", "tensorflow", default=True)
class MultiWorkerRuntime(Runtime):
    """A `MultiWorkerMirroredStrategy`: the replicas span the workers."""

    spans_workers = True

    @property
    def whole_remainder(self) -> str | None:
        """A short last batch is not run whole in every replica here (its workers' own pipelines:
        not built): "whole" on one replica, else None."""
        return "whole" if self.num_replicas == 1 else None

    @staticmethod
    def local_devices(native) -> int | None:
        return None  # Its replicas span the workers; the plan lists this one's devices.

    def reads_steps_per_execution(self, model, kind: str) -> bool:
        """Every train and test step function is ours (Keras 3 fails to reduce a
        multi-worker strategy's logs, `reduction.reduce_logs`), and reads N at each call."""
        return not (kind == "predict" or model.run_eagerly)

    def wrap(self, batches, carry_mask: bool = True, preprocess=None):
        """Every worker's rows of each global batch as a distributed data set, through
        tf.data (arrays, a tf.data.Dataset); `Accelerator.dataset` too, whose batches a
        plain `model.fit` then takes as they are. Arrays on disk go through tf.data here:
        each worker keeps only its rows of each batch there (`distribute`)."""
        from keras_accel.data import tfdata

        own = batches.own_files if isinstance(batches, tfdata.TFDatasetBatches) else None
        if own is not None and carry_mask:  # This worker's own files: its rows of each batch.
            mine = own.pipeline(carry_mask, preprocess)
            distributed = self.distribute(mine, own.plan.static_rows, own=True)
            return DistributedBatches(distributed, mine, num_batches=None)
        if not isinstance(batches, (ArrayBatches, tfdata.TFDatasetBatches)):
            raise ValueError(
                "Under MultiWorkerMirroredStrategy keras_accel feeds each worker its rows of "
                "every global batch through tf.data; a keras.utils.PyDataset, a generator or a "
                "Grain data set has no tf.data form here. Received: "
                f"{type(batches.source).__name__}. Pass arrays or a tf.data.Dataset."
            )
        pipeline = self.pipeline(batches, carry_mask, preprocess)
        distributed = self.distribute(pipeline, batches.plan.static_rows)
        return DistributedBatches(distributed, pipeline, num_batches=batches.plan.num_batches)

    def distribute(self, pipeline, static_rows: int, own: bool = False):
        """Each worker keeps its rows of every global batch of `static_rows` (unless `own`:
        the pipeline holds only this worker's rows already, its own files), and each of its
        replicas gets its slice of those. This is what auto-sharding by data would do,
        except that it shards rows of each batch, not whole batches: whole batches would
        give each worker other global batches."""
        from keras_accel.data import tfdata
        from keras_accel.utils import process

        if not own:
            share = static_rows // process.num_processes()
            index = process.process_index()
            pipeline = tfdata.take_rows(pipeline, slice(index * share, (index + 1) * share))
        return self.replica_slices(pipeline)

    def own_files(self, batches):
        """This worker's own files of a file-backed pipeline where every worker can read its
        own (`keras_accel.data.tfdata.ProcessFiles`), else None. Where the workers' data
        end after different numbers of batches, `tf.distribute`'s partial-batch handling
        feeds an empty batch to a worker that ran out, as long as another has data (its
        `get_next_as_optional` all-reduces which workers have a batch, every step): the step
        weights nothing there."""
        from keras_accel.data import tfdata
        from keras_accel.utils import process

        own = tfdata.process_files(batches, process.num_processes(), process.process_index())
        return own if cluster.agree_all(own is not None) else None
