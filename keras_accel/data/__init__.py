"""Data: static-shape batching for any input, and the seed data sets (CIFAR-10, text)."""

from keras_accel.data.batching import REMAINDER_POLICIES, BatchPlan, static_batch_size

__all__ = ["REMAINDER_POLICIES", "BatchPlan", "static_batch_size"]
