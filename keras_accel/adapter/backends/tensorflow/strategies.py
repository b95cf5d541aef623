"""The tf.distribute strategy that `single`, `data_parallel` and `mirrored` build (the
registry's TensorFlow builders, `keras_accel.adapter.strategies.STRATEGIES`; they run under
the base `runtime.Runtime`), and the refusals of the JAX-only names. `multi_worker` and
`tpu` are modules of their own, builder and runtime together."""

from __future__ import annotations

import warnings

import tensorflow as tf

from keras_accel.adapter.strategies import STRATEGIES, Plan
from keras_accel.utils.devices import parse_device_name


def tf_device_name(device: str) -> str:
    """keras_accel's "gpu:1" as TensorFlow names it: "/device:GPU:1"."""
    platform, index = parse_device_name(device)
    return f"/device:{platform.upper()}:{index}"


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A MirroredStrategy whose collective keys cannot clash with another strategy's.

    Every `tf.distribute.MirroredStrategy` numbers its collective groups and instances from
    the same start, so two strategies over the same devices in one process (a user's raw
    one and ours, in either order) send different tensors under the same keys and abort each
    other ("Shape mismatch in the collective instance"; then "Function was cancelled"). Ours
    start from a base of their own.
    """

    def __init__(self, devices, key_base: int, cross_device_ops=None):
        self._collective_key_base = key_base  # Read by MirroredExtended's __init__.
        super().__init__(devices, cross_device_ops=cross_device_ops)

    def experimental_distribute_dataset(self, dataset, options=None):
        # What a plain `model.fit` (`evaluate`, `predict`) calls on a model built in
        # `acc.scope()`: Keras's TF trainer distributes the user's data with it.
        _warn_if_uneven(dataset, self.num_replicas_in_sync)
        return super().experimental_distribute_dataset(dataset, options)


def _warn_if_uneven(dataset, replicas: int) -> None:
    """Warn, before the first step, that a plain `model.fit` on a model built in the
    Accelerator's scope is raw `MirroredStrategy` training, where a batch that does not
    split over the replicas leaves some with fewer rows than others, or none:
    BatchNormalization's statistics over no rows are NaN, and the weights turn NaN while
    the reported loss may stay finite. The Accelerator's own calls feed batches of a
    static, padded size (no warning), as does `acc.dataset(...)`, whose batches a plain
    `model.fit` takes as they are."""
    from keras_accel.adapter import session

    if session.in_call():
        return
    leaves = [s for s in tf.nest.flatten(dataset.element_spec) if hasattr(s, "shape")]
    sizes = {s.shape[0] if s.shape.rank else None for s in leaves}
    if len(sizes) == 1 and None not in sizes and next(iter(sizes)) % replicas == 0:
        return
    shown = (
        "of varying size (a last, partial batch among them)"
        if None in sizes
        else "of " + ", ".join(str(size) for size in sorted(sizes)) + " rows"
    )
    warnings.warn(
        f"A plain Keras call (model.fit, evaluate or predict) on a model built in "
        f"Accelerator.scope() runs raw tf.distribute.MirroredStrategy over {replicas} "
        f"replicas, with batches {shown}. A batch that does not split over the replicas "
        "gives some of them fewer "
        "rows or none: BatchNormalization's statistics over no rows are NaN, and the "
        "weights can turn NaN while the reported loss stays finite. Use acc.fit(model, ...) "
        "(acc.evaluate, acc.predict), which pads every batch exactly, or feed "
        "acc.dataset(...), whose batches split evenly.",
        stacklevel=3,
    )


def cross_device_ops(devices: tuple):
    """How our MirroredStrategy sums across `devices`: TensorFlow's default (collective ops,
    NCCL on GPUs), except where every device is a CPU of this host.

    There the replicas share one memory, and TensorFlow's default collective costs a
    rendezvous of the replicas' collective executors per all-reduce: over 8 CPU devices
    0.8-1.5 ms for 3 to 512 floats against 0.06-0.13 ms for `ReductionToOneDevice` (copies
    into one device, one AddN, copies back), and 30 against 17 ms for 1.6 million floats
    (benchmarks/tf_all_reduce.py). A step of ours all-reduces more often than plain Keras's
    (each BatchNormalization layer's batch sums forward and backward, the real-row count,
    the metrics' global results), and those per-call costs were the whole of `acc.fit`'s
    gap to plain `model.fit` on CPU replicas (docs/benchmarks.md). GPUs keep TensorFlow's
    choice (NCCL), TPUs their own strategy.
    """
    if all(parse_device_name(d)[0] == "cpu" for d in devices):
        return tf.distribute.ReductionToOneDevice()
    return None


_MIRRORED: dict[tuple, tf.distribute.MirroredStrategy] = {}
_KEY_BASE = 1 << 20  # Far above the keys a raw strategy hands out in one process.


def _mirrored(devices: tuple) -> tf.distribute.MirroredStrategy:
    # One strategy per device set and process: ours must not clash with each other either.
    if devices not in _MIRRORED:
        base = _KEY_BASE * (len(_MIRRORED) + 1)
        _MIRRORED[devices] = _MirroredStrategy(
            [tf_device_name(d) for d in devices], base, cross_device_ops(devices)
        )
    return _MIRRORED[devices]


@STRATEGIES.builder("single", "tensorflow", default=True)
def _single(plan: Plan, layout_map):
    return None  # The Runtime places variables on the one device (`Runtime.device_scope`).


@STRATEGIES.builder("data_parallel", "tensorflow", default=True)
@STRATEGIES.builder("mirrored", "tensorflow", default=True)
def _data_parallel(plan: Plan, layout_map):
    return _mirrored(tuple(plan.devices))


@STRATEGIES.builder("model_parallel", "tensorflow", default=True)
@STRATEGIES.builder("fsdp", "tensorflow", default=True)
def _jax_only(plan: Plan, layout_map):
    what = {
        "model_parallel": "variables laid out by a LayoutMap over a (data, model) mesh "
        "(keras.distribution.ModelParallel)",
        "fsdp": "every variable split over the devices, gathered by the compiler where a "
        "step needs it (keras.distribution layouts, compiled by XLA's partitioner)",
    }.get(plan.strategy, "a keras.distribution layout")
    also = " (or torch's, over processes)" if plan.strategy == "fsdp" else ""
    raise ValueError(
        f"strategy={plan.strategy!r} needs the JAX backend{also}: {what}; tf.distribute has "
        "no equivalent in Keras 3. Received: KERAS_BACKEND=tensorflow. Use KERAS_BACKEND=jax, "
        "or strategy='data_parallel'."
    )
