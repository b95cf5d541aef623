"""What must see the global batch's rows where each process (torch) or replica (TensorFlow)
holds a share of it, shared by both backends (it imports neither): which metrics keep a
state that the processes' states do not add up to, and which layers draw per row.

The backends act on these: `keras_accel.adapter.backends.torch.rows` (processes) and
`keras_accel.adapter.backends.tensorflow.rows` and `.reduction` (replicas). JAX's arrays are
global: one program sees the whole batch, and needs none of this. What they install, they
install alike (`install_row_draws`, `UserMetricPatches`); each supplies only what differs:
its draw over the global batch keeping its own rows, its gather of a metric's update.
"""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_accel.adapter.steps import after_build
from keras_accel.utils import keras_internals

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


def draws_of_its_own(layer) -> bool:
    """Whether `layer` is a layer of the user's (its class not Keras's) that holds a
    `keras.random.SeedGenerator` and no layers: it draws random numbers itself, whose shape
    Keras's convention takes from its input's, the batch on axis 0 (keras-io's VAE's
    `Sampling`: `keras.random.normal(shape=(batch, dim), seed=self.seed_generator)`). Run
    on the global batch's shape it draws one device's numbers, whether its draw is per row,
    per batch or of a fixed shape; it may draw in inference too (it need not take
    `training`)."""
    if type(layer).__module__.startswith("keras.src.") or isinstance(layer, keras.Model):
        return False
    if keras_internals.flatten_layers(layer, include_self=False):
        return False
    return any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())


def install_row_draws(patches, model, global_call: Callable) -> int:
    """Installs `global_call(layer.call, own)` as the `call` of every layer of `model` that
    `draws` (`own` False: it draws in training only, given `training`) or
    `draws_of_its_own` (`own` True: at every call, its inputs any structure of tensors that
    share their rows); returns how many. `global_call` is the backend's: the original call
    on a global-batch-shaped input, this process's or replica's rows of its output kept."""
    count = 0
    for layer in keras_internals.flatten_layers(model):
        if draws(layer):
            patches.set(layer, "call", global_call(layer.call, False))
            count += 1
        elif draws_of_its_own(layer):
            patches.set(layer, "call", global_call(layer.call, True))
            count += 1
    return count


def is_keras_metric(metric) -> bool:
    """Whether `metric` is an instance of one of Keras's own classes, whose state (sums and
    counts, Keras's default aggregation) the processes' states add up to; a subclass of the
    user's may keep any state."""
    return type(metric).__module__.startswith("keras.src.")


def metric_leaves(metrics):
    """The metrics in `metrics` (inside Keras's per-output containers too) that update
    state themselves."""
    for metric in metrics or []:
        if metric is None:
            continue
        inner = getattr(metric, "metrics", None)
        if is_keras_metric(metric) and isinstance(inner, (list, tuple)) and inner is not metrics:
            yield from metric_leaves(inner)
        elif callable(getattr(metric, "update_state", None)):
            yield metric


def user_metrics(metrics):
    """The metrics in `metrics` (inside Keras's per-output containers too) that update
    state themselves and are not Keras's own."""
    return (metric for metric in metric_leaves(metrics) if not is_keras_metric(metric))


class UserMetricPatches:
    """Patches each of users' metrics (`user_metrics`) once, however often `install` meets
    it: a backend's subclass says how (`patch`: its update on the global batch's rows).
    A subclass may `select` other metrics."""

    def __init__(self):
        self._done: set[int] = set()

    def select(self, metrics):
        return user_metrics(metrics)

    def install(self, patches, metrics) -> None:
        for metric in self.select(metrics):
            if id(metric) in self._done:
                continue
            self._done.add(id(metric))
            self.patch(patches, metric)

    def install_on_model(self, patches, model) -> None:
        """On `model`'s metrics, and on the compiled ones once Keras builds them."""
        self.install(patches, model.metrics)
        compiled = keras_internals.compile_metrics(model)
        if compiled is not None:
            after_build(patches, compiled, lambda: self.install(patches, compiled.metrics))

    def patch(self, patches, metric) -> None:
        raise NotImplementedError


class FirstReplicaCounts(UserMetricPatches):
    """In a replicated step (`steps.REPLICATED`: the short last batch, which every process or
    replica runs whole), the updates of Keras's own metrics that count rows count on the
    first replica only (`is_first()`), as if the others had held none of the batch: Keras's
    metrics are summed over the replicas when read.

    Which updates count rows: those given per-row values (targets and predictions, a loss
    per row) or a weight (Keras's loss tracker: the batch's loss weighted by its rows); in
    every other step each replica adds its own rows, and these sum to the global batch's.
    An update of one value without a weight (a custom step's
    `loss_tracker.update_state(loss)`) counts one entry per replica in every other step,
    each replica's own loss, so that a mean over them is the mean over the batches; in a
    replicated step it counts on every replica too, with the batch's loss, for the same
    weight. Users' metrics are updated on the global batch's rows by the backends
    (`torch_rows.GatheredMetrics`, `tensorflow.reduction.GatheredMetrics`), which hold
    their state alike and need nothing here."""

    def __init__(self, is_first: Callable[[], bool]):
        super().__init__()
        self.is_first = is_first

    def select(self, metrics):
        return (metric for metric in metric_leaves(metrics) if is_keras_metric(metric))

    def patch(self, patches, metric) -> None:
        patches.set(metric, "update_state", self._counted(metric.update_state))

    def _counted(self, update_state):
        from keras_accel.adapter.steps import REPLICATED

        def update(*args, **kwargs):
            if REPLICATED.get() and _counts_rows(args, kwargs) and not self.is_first():
                return None
            return update_state(*args, **kwargs)

        return update


def _counts_rows(args, kwargs) -> bool:
    # (A wrapper may hand `sample_weight=None` on: no weight.)
    if kwargs.get("sample_weight") is not None:
        return True
    given = [*args, *(v for k, v in kwargs.items() if k != "sample_weight")]
    if len(given) != 1:
        return True
    shape = getattr(given[0], "shape", ())
    return shape is not None and len(shape) > 0
