"""What must see the global batch's rows where each process (torch) or replica (TensorFlow)
holds a share of it, shared by both backends (it imports neither): which metrics keep a
state that the processes' states do not add up to, and which layers draw per row.

The backends act on these: `keras_accel.adapter.backends.torch_rows` (processes) and
`keras_accel.adapter.backends.tensorflow.rows` and `.reduction` (replicas). JAX's arrays are
global: one program sees the whole batch, and needs none of this.
"""

from __future__ import annotations

import keras

# Layers whose randomness is drawn per row, from the shape of their input's batch: they draw
# the global batch's numbers in every process and replica. A layer of the user's that draws
# per row can be added here (its `call(inputs, training=...)` must keep the batch on axis
# 0); read at each call.
RANDOM_ROW_LAYERS: tuple[type, ...] = (
    keras.layers.Dropout,  # SpatialDropout1D/2D/3D are Dropouts.
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.AlphaDropout,
)


def draws(layer) -> bool:
    """Whether `layer` is one of `RANDOM_ROW_LAYERS` that draws anything: a rate or a noise
    of 0 (keras-hub's models with `dropout=0`) returns its input as it is, which no process
    count changes."""
    return isinstance(layer, RANDOM_ROW_LAYERS) and all(
        getattr(layer, name, None) != 0 for name in ("rate", "stddev")
    )


def is_keras_metric(metric) -> bool:
    """Whether `metric` is an instance of one of Keras's own classes, whose state (sums and
    counts, Keras's default aggregation) the processes' states add up to; a subclass of the
    user's may keep any state."""
    return type(metric).__module__.startswith("keras.src.")


def user_metrics(metrics):
    """The metrics in `metrics` (inside Keras's per-output containers too) that update
    state themselves and are not Keras's own."""
    for metric in metrics or []:
        if metric is None:
            continue
        inner = getattr(metric, "metrics", None)
        if is_keras_metric(metric) and isinstance(inner, (list, tuple)) and inner is not metrics:
            yield from user_metrics(inner)
        elif not is_keras_metric(metric) and callable(getattr(metric, "update_state", None)):
            yield metric
