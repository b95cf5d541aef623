"""Grain inputs (`grain.MapDataset`, `grain.IterDataset`, `grain.DataLoader`), as Keras reads
them: one full pass of the data set per epoch, on JAX and on TensorFlow.

A Python generator cannot tell Keras where an epoch ends, and Keras reads one on from where
the last epoch stopped; a Grain data set is re-iterable, and Keras's own Grain adapter starts
a fresh pass every epoch (ended by the pass's end; `steps_per_epoch` only where given). So
a Grain data set reaches Keras as `GrainPasses`, a Keras `DataAdapter` (Keras's
`get_data_adapter` takes any `DataAdapter` as it is), each of whose iterators is a new pass
of `keras_accel.data.sources.IterableBatches.batches()`: padded batches with their row mask.

Grain itself is never imported here: the batches are numpy already (`IterableBatches`
converts what the data set yields). This module is imported only when a Grain data set
(or another re-iterable stream) is given.
"""

from __future__ import annotations

import keras
import numpy as np

from keras_accel.data.adapters import PaddedBatchesAdapter
from keras_accel.data.batching import element


class GrainPasses(PaddedBatchesAdapter):
    """A Keras data adapter over a re-iterable `IterableBatches`: each `get_*_iterator()` is
    one new pass of the data set, its batches as `keras_accel.data.pydataset.stream` serves
    them (`carry_mask`, `rows`: this process's rows of each global batch). On JAX a
    process's own files of a tf.data pipeline (`keras_accel.data.tfdata.ProcessFiles`) are
    served the same way: one pass per epoch, its padded batches as numpy.

    `num_batches` is the data set's length where it knows one (a `MapDataset`; not under
    remainder="drop", which may skip a partial batch): Keras then ends an epoch after that
    many steps and starts the next pass. Without one (an `IterDataset`, a `DataLoader`) the
    pass's end ends the epoch, as under Keras's own Grain adapter (which says so each epoch:
    "Your input ran out of data").
    """

    def __init__(self, batches, carry_mask: bool = True, rows=None):
        self.batches = batches
        self.carry_mask = carry_mask
        self.rows = rows
        self._tf_signature = None

    def _pass(self):
        for batch in self.batches.batches(scale=not self.carry_mask):
            yield element(batch, self.carry_mask, self.rows)

    def keras_accel_first_batch(self):
        # What `Accelerator` builds the model from (`_first_batch`): the stream's first
        # batch, kept aside (only its structure and shapes beyond the batch axis count).
        return self.batches.first_batch()

    def get_numpy_iterator(self):
        return self._pass()

    def get_jax_iterator(self, super_batch=None):
        return self.jax_batches(self._pass(), super_batch)

    def get_tf_dataset(self):
        import tensorflow as tf

        if self._tf_signature is None:
            first = element(self.batches.first_batch(), self.carry_mask, self.rows)
            self._tf_signature = tf.nest.map_structure(
                _tensor_spec, keras.tree.lists_to_tuples(first)
            )

        def one_pass():
            for item in self._pass():
                yield keras.tree.lists_to_tuples(item)

        dataset = tf.data.Dataset.from_generator(one_pass, output_signature=self._tf_signature)
        return dataset.prefetch(tf.data.AUTOTUNE)

    @property
    def num_batches(self):
        return self.batches.plan.num_batches


def _tensor_spec(leaf):
    import tensorflow as tf

    leaf = np.asarray(leaf)
    dtype = tf.string if leaf.dtype.kind in "OUS" else tf.as_dtype(leaf.dtype)
    return tf.TensorSpec(leaf.shape, dtype)
