"""Keras's trainers: the classes of `keras.Model.__mro__` that hold `fit` and the steps (the
backend's trainer, found as the one defining `make_train_function`), their symbolic build,
their loss hooks, the TF trainer's module and Keras 3.16's torch DDP wrapping."""

from __future__ import annotations

from collections.abc import Callable

import keras

from keras_accel.utils.keras_internals.compile_utils import (
    COMPILE_ATTRIBUTES,
    compile_loss,
    compile_metrics,
)
from keras_accel.utils.keras_internals.layers import LAYER_ATTRIBUTES, flatten_layers
from keras_accel.utils.keras_internals.lookup import (
    Internal,
    class_in_mro,
    holder,
    module_of_class,
    public,
    require,
)

# The backend's trainer class: where Keras creates its step functions.
BACKEND_TRAINER = class_in_mro("keras.Model", defining="make_train_function")

REDUCE_PER_REPLICA = Internal(
    "the TF trainer's module (in keras.Model.__mro__)",
    "reduce_per_replica",
    "fused steps on TF",
    module_of_class(BACKEND_TRAINER),
)
# Checked by `keras_internals.check()`.
REQUIRED = [
    Internal(
        "keras.Model", "_symbolic_build", "building a model from a batch", public("keras.Model")
    ),
]
# Checked by `keras_internals.check()` where TensorFlow is the backend.
REQUIRED_TENSORFLOW = [
    Internal(
        "keras.Model",
        "_compute_loss",
        "the loss a custom step reports on TF",
        public("keras.Model"),
    ),
    Internal(
        "keras.Model",
        "_aggregate_additional_loss",
        "the regularization losses a class's own compute_loss sees on TF",
        public("keras.Model"),
    ),
    Internal(
        "keras.Model",
        "_maybe_symbolic_build",
        "building a model from a batch of strings",
        public("keras.Model"),
    ),
    REDUCE_PER_REPLICA,
]
# Instance attributes, which no class holds: Keras sets them in `__init__` (the model's in
# `Trainer.__init__`, a layer's graph nodes in `Operation.__init__`), so they are checked on
# the model itself by `keras_internals.check_model`.
MODEL_ATTRIBUTES = {
    **COMPILE_ATTRIBUTES,
    "_initial_epoch": "where a restored fit starts",
    **LAYER_ATTRIBUTES,
    "_compute_loss": "the loss Keras's step computes (a compiled torch step calls it)",
}


def compute_loss_of(model) -> Callable:
    """The model's `_compute_loss`: `compute_loss`, or the user's override of it, as
    Keras's steps call it."""
    return require(model, "_compute_loss", MODEL_ATTRIBUTES["_compute_loss"])


def initial_epoch(model) -> int | None:
    """The epoch Keras's `fit` starts at instead of its `initial_epoch` argument (what a
    restore sets; `model._initial_epoch`): None when nothing set one."""
    return require(model, "_initial_epoch", MODEL_ATTRIBUTES["_initial_epoch"])


def set_initial_epoch(model, epoch: int | None) -> None:
    """Make the next `fit` start at `epoch` (None: at its `initial_epoch` argument). The
    attribute must exist: writing a name Keras no longer reads would do nothing."""
    initial_epoch(model)
    model._initial_epoch = epoch


def distribute_strategy_of(model):
    """The tf.distribute strategy a model was created under (None outside any)."""
    return require(model, "_distribute_strategy", "which strategy a model belongs to")


def tf_trainer_module():
    """The module whose `reduce_per_replica` Keras's TF step functions call: the module of
    the TF trainer class in `keras.Model.__mro__` (the class defining `make_train_function`;
    `TensorFlowTrainer` in Keras 3.15, `Trainer` in 3.16)."""
    return holder(REDUCE_PER_REPLICA)


def reduce_per_replica():
    """Keras's reduction of a step's per-replica logs (what its TF step functions apply)."""
    return tf_trainer_module().reduce_per_replica


def needs_symbolic_build(model) -> bool:
    """Whether Keras would still build some of the model's state (layers, compiled metrics
    or losses) from the first batch."""
    compiled_metrics = compile_metrics(model)
    compiled_loss = compile_loss(model)
    return (
        not all(layer.built for layer in flatten_layers(model, include_self=False))
        or not model.built
        or (compiled_metrics is not None and not compiled_metrics.built)
        or (compiled_loss is not None and not compiled_loss.built)
        or (getattr(model, "optimizer", None) is not None and not model.optimizer.built)
    )


def reads_a_batch_to_build(model) -> bool:
    """Whether Keras's `_symbolic_build` would read a batch from its data now: some layer,
    compiled metric or compiled loss is unbuilt (an unbuilt optimizer it builds without one)."""
    compiled_metrics = compile_metrics(model)
    compiled_loss = compile_loss(model)
    return (
        not all(layer.built for layer in flatten_layers(model))
        or (compiled_metrics is not None and not compiled_metrics.built)
        or (compiled_loss is not None and not compiled_loss.built)
    )


def install_symbolic_build(
    patches, model, first_batch, overrides_a_step: bool, skipped_read=None, deferrable=False
) -> None:
    """For the duration of `patches`, Keras builds `model` from `first_batch()`: the batch as
    the model's step sees it, not the Accelerator's batch with its row mask.

    `skipped_read(data_adapter)`, where given, is called where Keras would have read the first
    batch of its epoch iterator's data to build (`reads_a_batch_to_build`), which it does not
    here: what reading it would have done beside (torch's random draws, `keras_accel.data.
    torch_feed.draw_as_keras_reads`).

    A model whose layers are all built but which has no `call` of its own (a GAN that
    overrides `train_step` around two sub-models, as in Keras's guide) cannot be built
    symbolically; Keras fails there under any distribution. Such a model is left to build
    at its first step, as Keras does on one TensorFlow device, and only its optimizer is
    built here.

    `deferrable`: where Keras itself builds nothing before the first step (TensorFlow on one
    device), a model that cannot be built from a batch this way is left to build there, as
    Keras would, whatever the error.
    """
    original = require(model, "_symbolic_build", "building a model from a batch")

    def build(iterator=None, data_batch=None):
        reads = skipped_read is not None and data_batch is None and iterator is not None
        if reads and reads_a_batch_to_build(model):
            skipped_read(iterator.data_adapter)
        if not needs_symbolic_build(model):
            return None
        try:
            return original(data_batch=first_batch())
        except Exception as error:
            if deferrable:
                return None
            if not isinstance(error, RuntimeError):
                raise
            inner = flatten_layers(model, include_self=False)
            if not overrides_a_step or not all(layer.built for layer in inner):
                raise
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        return None

    patches.set(model, "_symbolic_build", build)


def replace_tf_symbolic_build(patches, model) -> None:
    """TF: for the duration of `patches`, the trainer's `_maybe_symbolic_build` (which builds
    from a batch it reduces across replicas first) builds through `model._symbolic_build`
    (`install_symbolic_build`'s, from the batch the model's step sees)."""
    require(model, "_maybe_symbolic_build", "the TF trainer's build")
    symbolic_build = require(model, "_symbolic_build", "building a model from a batch")

    def build(iterator=None, data_batch=None):
        symbolic_build()

    patches.set(model, "_maybe_symbolic_build", build)


def replace_compute_loss(patches, model, make: Callable) -> None:
    """For the duration of `patches`, `model`'s loss goes through `make(keras_compute_loss,
    compute_loss)`'s pair: the first is what Keras's own steps call (`_compute_loss`, which
    then calls `compute_loss`), the second what a custom step calls (`compute_loss`)."""
    keras_step_loss = require(model, "_compute_loss", "the loss a custom step reports on TF")
    in_keras_step, compute_loss = make(keras_step_loss, model.compute_loss)
    patches.set(model, "_compute_loss", in_keras_step)
    patches.set(model, "compute_loss", compute_loss)


def replace_added_losses(patches, model, added: Callable) -> None:
    """For the duration of `patches`, Keras's `compute_loss` sums each added loss
    (regularizers, `add_loss`; TF divides each by the replica count) through
    `added(model._aggregate_additional_loss)`."""
    aggregate = require(
        model,
        "_aggregate_additional_loss",
        "the added losses (regularizers, add_loss) a class's own compute_loss sees on TF",
    )
    patches.set(model, "_aggregate_additional_loss", added(aggregate))


def step_aside_from_keras_ddp(patches, model) -> Callable | None:
    """Keras 3.16's torch trainer wraps the model in `DistributedDataParallel` whenever a
    process group exists (`_initialize_ddp`) and sums every metric variable over the
    processes in its own `get_metrics_result`. The Accelerator averages the gradients once
    and reduces metrics by each variable's aggregation itself: for the duration of
    `patches` Keras's wrapping is skipped. Returns the trainer-independent
    `get_metrics_result` (Keras's base trainer's, which reads each metric's `result()`) where
    Keras's torch trainer overrides it, else None. Keras 3.15 has neither: nothing is
    changed."""
    if not hasattr(type(model), "_initialize_ddp"):
        return None
    if getattr(model, "ddp_model", None) is not None:
        raise RuntimeError(
            f"This model was wrapped in DistributedDataParallel by a plain model.fit in a "
            f"process group (Keras {keras.__version__}); the Accelerator averages the "
            "gradients itself and would reduce them twice. Train it through the "
            "Accelerator only, or build it again."
        )
    patches.set(model, "_initialize_ddp", lambda: None)
    for klass in type(model).__mro__:
        if "get_metrics_result" in vars(klass) and not hasattr(klass, "_initialize_ddp"):
            return vars(klass)["get_metrics_result"].__get__(model)
    return None
