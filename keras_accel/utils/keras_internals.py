"""Every Keras internal keras_accel touches, listed in one place and checked once.

keras_accel uses Keras's public API wherever Keras has one. Where it has no public extension
point, the private names below are what keras_accel relies on; `check()` verifies all of them
against the installed Keras (`Accelerator.prepare` calls it), so that a Keras release that
renames one fails loudly, naming the Keras version and the name, instead of quietly doing
nothing. Code elsewhere reads these names through this module only.
"""

from __future__ import annotations

import functools
import importlib

import keras

TESTED_KERAS = "3.15"

# (where, name, why): module-level names and class attributes keras_accel reads or replaces.
# Instance attributes that Keras sets in __init__ are checked on the instance (`require`).
REQUIRED: list[tuple[str, str, str]] = [
    ("keras.src.backend.config", "keras_home", "where keras.json lives (`keras-accel env`)"),
    ("keras.src.backend.common.global_state", "set_global_attribute", "seeding"),
    ("keras.src.utils.rng_utils", "GLOBAL_RANDOM_SEED", "seeding"),
    ("keras.src.random.seed_generator", "GLOBAL_SEED_GENERATOR", "seeding"),
    ("keras.src.trainers.trainer:Trainer", "_symbolic_build", "building a model from a batch"),
    ("keras.src.backend", "IS_THREAD_SAFE", "synchronous callbacks across JAX processes"),
    ("keras.layers:Layer", "_flatten_layers", "finding BatchNormalization layers"),
    ("keras.layers:BatchNormalization", "_moments", "BatchNormalization over real rows"),
    ("keras.src.trainers.compile_utils:CompileMetrics", "build", "masking compiled metrics"),
    ("keras.src.trainers.compile_utils:CompileLoss", "build", "per-output loss trackers"),
    ("keras.src.trainers.compile_utils:CompileLoss", "metrics", "per-output loss trackers"),
    ("keras.src.trainers.compile_utils:CompileMetrics", "metrics", "the compiled metrics"),
    # keras_accel.callbacks: ModelCheckpoint extends Keras's through these hooks.
    ("keras.callbacks:ModelCheckpoint", "_save_model", "ModelCheckpoint's chief-only save"),
    ("keras.callbacks:ModelCheckpoint", "_get_file_path", "ModelCheckpoint's file names"),
    ("keras.callbacks:ModelCheckpoint", "_should_save_model", "ModelCheckpoint's best value"),
]
# Instance attributes read through `require` where they are used: `model._compile_metrics`
# (`_flat_metrics`, `_flat_weighted_metrics`), `model._compile_loss`, `model._loss_tracker`,
# `model._distribute_strategy` (TF), `BatchNormalization._reduction_axes`; and, in
# keras_accel.callbacks, `optimizer._learning_rate`, `_variables`, `_iterations`,
# `variable._layout` (JAX), `model._initial_epoch`, `Callback._model`,
# `ModelCheckpoint._current_epoch`, and Keras's BackupAndRestore file names.
# Only where TensorFlow is the backend (checked by `check()` then).
REQUIRED_TENSORFLOW: list[tuple[str, str, str]] = [
    ("keras.src.losses.loss", "scale_loss_for_distribution", "global-batch losses on TF"),
    ("keras.src.losses.loss", "unscale_loss_for_distribution", "global-batch losses on TF"),
    ("keras.src.backend.tensorflow.optimizer:TFOptimizer", "apply", "averaged gradients"),
    (
        "keras.src.backend.tensorflow.optimizer:TFOptimizer",
        "_all_reduce_sum_gradients",
        "averaged gradients",
    ),
    (
        "keras.src.backend.tensorflow.trainer:TensorFlowTrainer",
        "_maybe_symbolic_build",
        "building a model from a batch of strings",
    ),
    (
        "keras.src.backend.tensorflow.trainer",
        "reduce_per_replica",
        "fused steps on TF; multi-worker logs",
    ),
]


class KerasInternalsError(RuntimeError):
    """A Keras internal that keras_accel relies on is missing from the installed Keras."""


def _error(where: str, name: str, why: str) -> KerasInternalsError:
    return KerasInternalsError(
        f"keras_accel relies on the Keras internal `{where}.{name}` ({why}), which Keras "
        f"{keras.__version__} does not have. keras_accel is tested with Keras {TESTED_KERAS}: "
        f'install it with `pip install -c constraints.txt -e ".[all]"` (or '
        f'"keras=={TESTED_KERAS}.*"), or report this Keras version to keras_accel.'
    )


def _resolve(where: str):
    module, _, attribute = where.partition(":")
    target = importlib.import_module(module)
    for part in filter(None, attribute.split(".")):
        target = getattr(target, part)
    return target


@functools.cache
def check() -> None:
    """Verify every internal in `REQUIRED` once per process; raise `KerasInternalsError`."""
    required = list(REQUIRED)
    if keras.backend.backend() == "tensorflow":
        required += REQUIRED_TENSORFLOW
    for where, name, why in required:
        try:
            target = _resolve(where)
        except (ImportError, AttributeError):
            raise _error(where, name, why) from None
        if not hasattr(target, name):
            raise _error(where, name, why)


def require(obj, name: str, why: str):
    """`getattr(obj, name)`, or a `KerasInternalsError` naming the Keras version."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise _error(type(obj).__qualname__, name, why) from None


def keras_home() -> str:
    """The Keras home directory that Keras chose at import (KERAS_HOME, ~/.keras or
    /tmp/.keras when the home directory is read-only)."""
    from keras.src.backend import config

    return config.keras_home()


def needs_symbolic_build(model) -> bool:
    """Whether Keras would still build some of the model's state (layers, compiled metrics
    or losses) from the first batch."""
    compiled_metrics = getattr(model, "_compile_metrics", None)
    compiled_loss = getattr(model, "_compile_loss", None)
    return (
        not all(layer.built for layer in flatten_layers(model, include_self=False))
        or not model.built
        or (compiled_metrics is not None and not compiled_metrics.built)
        or (compiled_loss is not None and not compiled_loss.built)
        or (getattr(model, "optimizer", None) is not None and not model.optimizer.built)
    )


def install_symbolic_build(patches, model, first_batch, overrides_a_step: bool) -> None:
    """For the duration of `patches`, Keras builds `model` from `first_batch()`: the batch as
    the model's step sees it, not the Accelerator's batch with its row mask.

    A model whose layers are all built but which has no `call` of its own (a GAN that
    overrides `train_step` around two sub-models, as in Keras's guide) cannot be built
    symbolically; Keras fails there under any distribution. Such a model is left to build
    at its first step, as Keras does on one TensorFlow device, and only its optimizer is
    built here.
    """
    original = require(model, "_symbolic_build", "building a model from a batch")

    def build(iterator=None, data_batch=None):
        if not needs_symbolic_build(model):
            return None
        try:
            return original(data_batch=first_batch())
        except RuntimeError:
            inner = flatten_layers(model, include_self=False)
            if not overrides_a_step or not all(layer.built for layer in inner):
                raise
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(model.trainable_variables)
        return None

    patches.set(model, "_symbolic_build", build)


def flatten_layers(model, include_self: bool = True) -> list:
    """Every layer of `model`, nested models included."""
    flatten = require(model, "_flatten_layers", "finding the layers of a model")
    return list(flatten(include_self=include_self, recursive=True))


def distribute_strategy_of(model):
    """The tf.distribute strategy a model was created under (None outside any)."""
    return require(model, "_distribute_strategy", "which strategy a model belongs to")


def loss_module():
    """Keras's loss helpers, whose replica scaling keras_accel replaces on TF."""
    from keras.src.losses import loss

    return loss


def tf_optimizer_class():
    """The class every Keras optimizer derives from on the TensorFlow backend."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer

    return TFOptimizer


def reduce_per_replica():
    """Keras's reduction of a step's per-replica logs (what its TF step functions apply)."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    return reduce_per_replica


def backend_module():
    """`keras.src.backend`, whose `IS_THREAD_SAFE` decides whether Keras runs batch-end
    callbacks in a thread pool."""
    return importlib.import_module("keras.src.backend")


def tf_trainer_module():
    """The module whose `reduce_per_replica` Keras's TF step functions call."""
    return importlib.import_module("keras.src.backend.tensorflow.trainer")


def set_global_seed(seed: int) -> None:
    """What `keras.utils.set_random_seed` does to Keras's own state, without importing
    TensorFlow on a JAX run (Keras's version imports it wherever it is installed)."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)


def global_seed_generator():
    """Keras's global SeedGenerator (what unseeded `keras.random` calls draw from), or None
    before anything created it."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
