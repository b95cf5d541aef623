"""Data: every input an Accelerator accepts, as static-shape padded batches; the seed data sets.

Each module one job:

- `batching`: the padding arithmetic (`BatchPlan`, `StreamPlan`), numpy, backend-free;
- `inputs`: which kind of input `x` is (`classify`), and its arrays and batches as numpy;
- `class_weights`: per-row weights from a `class_weight` dict, as Keras computes them;
- `array_batches`: arrays (in memory, memory-mapped or on disk) as padded batches by index;
- `on_disk`: arrays on disk read a batch of rows at a time;
- `sources`: streamed sources (PyDataset, generator, Grain, torch DataLoader) as padded
  batches as they come; the batches contract, and the one import of every input's batches;
- `tfdata`: in-memory arrays as tf.data pipelines, and the one import of the tf.data path:
  `tf_padding` (a batch padded in the graph), `tf_datasets` (a user's `tf.data.Dataset`,
  streamed), `tf_checks` (what a pipeline is, and Keras's rules for it), `tf_process_files`
  (one process's own files), `tf_shares` (a batch cut into processes' rows and replicas'
  slices);
- `adapters`, `pydataset`, `grain`, `groups`, `torch_feed`, `ahead`: the batches as Keras's
  trainers read them (data adapters, a PyDataset or generator, Grain passes, stacked groups,
  torch tensors, one batch ahead on the devices);
- `cifar10`, `text`: the seed data sets. `load_cifar10` reads CIFAR-10 from local files only
  (never downloading) and falls back to synthetic data of the same shape, saying so;
  `synthetic_text_classification` and `text_vocabulary` feed the BERT classifier.
"""

from keras_accel.data.batching import REMAINDER_POLICIES, BatchPlan, static_batch_size
from keras_accel.data.cifar10 import CifarFormatError, load_cifar10, synthetic_cifar10
from keras_accel.data.text import synthetic_text_classification, text_vocabulary

__all__ = [
    "REMAINDER_POLICIES",
    "BatchPlan",
    "CifarFormatError",
    "load_cifar10",
    "static_batch_size",
    "synthetic_cifar10",
    "synthetic_text_classification",
    "text_vocabulary",
]
