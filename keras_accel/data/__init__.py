"""Data: static-shape batching for any input, and the seed data sets (CIFAR-10, text).

`load_cifar10` reads CIFAR-10 from local files only (never downloading) and falls back to
synthetic data of the same shape, saying so; `synthetic_text_classification` and
`text_vocabulary` feed the BERT classifier.
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
