"""What TensorFlow refuses under a strategy, refused before the first step in our words."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_accel.utils.optimizers import inner_optimizer


def check_not_nested(ours) -> None:
    """TensorFlow cannot enter one strategy's scope inside another's ("Mixing different
    tf.distribute.Strategy objects"): say so in our words, with what works."""
    if not tf.distribute.has_strategy():
        return
    current = tf.distribute.get_strategy()
    if current is ours:
        return
    raise RuntimeError(
        f"acc.scope() (which acc.fit, evaluate and predict enter) was entered inside the "
        f"scope of another {type(current).__name__} "
        "(the user's own tf.distribute strategy), and TensorFlow cannot nest two strategies' "
        "scopes. Leave that scope first: build, compile and train the model in "
        "`with acc.scope():` alone, or use the other strategy without the Accelerator. Both "
        "can be used one after the other in one process; a model belongs to the strategy "
        "it was built under."
    )


def optimizers(model) -> list:
    """`model.optimizer` and the optimizers a custom step keeps on the model (a GAN's)."""
    found = [getattr(model, "optimizer", None)]
    found += [v for v in vars(model).values() if isinstance(v, keras.optimizers.Optimizer)]
    unique = {id(o): o for o in found if o is not None}
    return list(unique.values())


def check_gradient_accumulation(optimizer, num_replicas: int) -> None:
    """Refuse Keras's gradient accumulation with several replicas on TensorFlow, before the
    first step, with what works instead.

    Keras's TF optimizer accumulates inside an `ops.cond` whose update branch merges the
    replicas (`merge_call`); TensorFlow refuses a merge_call inside a cond of a replicated
    step ("merge_call called while defining a new graph"), with raw MirroredStrategy too.
    """
    inner = inner_optimizer(optimizer)
    steps = getattr(inner, "gradient_accumulation_steps", None)
    if num_replicas > 1 and steps:
        raise NotImplementedError(
            "Keras's gradient accumulation does not run under tf.distribute with more than "
            "one replica: its optimizer merges the replicas inside a cond, which TensorFlow "
            "refuses in a replicated step (raw MirroredStrategy fails the same way). "
            f"Received: {type(inner).__name__}(gradient_accumulation_steps={steps}) with "
            f"{num_replicas} replicas. Use KERAS_BACKEND=jax (accumulation works across "
            "replicas there), Accelerator(devices=1), or a global batch "
            f"{steps} times larger instead of accumulating."
        )


def check_optimizers_built(model) -> None:
    """Optimizers of a custom step (a GAN's two) must be built before the first step under
    tf.distribute: built lazily inside a replicated step, their slots fail to initialize
    ("You must feed a value for placeholder tensor"). Keras builds `model.optimizer` only."""
    for name, value in vars(model).items():
        if (
            isinstance(value, keras.optimizers.Optimizer)
            and value is not getattr(model, "optimizer", None)
            and not value.built
        ):
            raise ValueError(
                f"{type(model).__name__}.{name} is not built: under tf.distribute an "
                "optimizer must be built before the first training step, and Keras builds "
                "only `model.optimizer`. Build it inside `acc.scope()` with the variables it "
                f"updates, e.g. `model.{name}.build(sub_model.trainable_variables)`, before "
                "acc.fit."
            )
