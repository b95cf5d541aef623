"""TensorFlow: where a call's steps run with XLA other than as the model was compiled.

Keras's `jit_compile="auto"` turns XLA off on a machine with only CPUs (and under any
`tf.distribute` strategy), and the Accelerator keeps the model's setting, with two
exceptions, each for one call and put back when it returns:

- `auto`: on one CPU device, a long call of a model Keras left without XLA runs with it,
  one XLA program per fused group (`fused._XlaGroup`), where that was measured to be faster.
  A small step without XLA runs op by op in TensorFlow's graph executor: a Dense 64-10 model
  at batch 64 took 0.17 s an epoch of 1,024 steps against 0.033 s as XLA groups
  (docs/benchmarks.md, "Against a loop written by hand"). It needs all of: the model left
  without XLA (`jit_compile` False: Keras's "auto" on a CPU, or the user's explicit False,
  which Keras does not tell apart) and not `run_eagerly`; a model of Keras's own classes
  made only of the layers measured faster with XLA on a CPU (`MEASURED_FASTER`: the seed
  MLP without its Dropout layers took 0.81 times as long a step; with them 3.3 times, XLA's
  random numbers on a CPU being slow; the seed CNN at width 0.25, 74 times as long);
  a model that supports XLA (Keras's `jit_compile` setter checks); in-memory arrays read a
  group at a time (`Runtime.grouped`: other inputs would launch one XLA program per step,
  slower than no XLA); and at least `AUTO_AFTER_STEPS` steps between the model's training
  so far and this call (one XLA compilation pays for itself over about that many small
  steps). Once a model ran with it, its later calls keep it (its compiled steps are not
  traced again for each call's choice). `KERAS_ACCEL_TF_XLA=0` keeps the model's setting
  always. The numbers are XLA's: within float rounding of the steps without it, as with
  `jit_compile=True`.
- `without_xla`: under a MirroredStrategy over several CPU devices, a model compiled with
  `jit_compile=True` runs without XLA, which does not run there.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref

import keras

# Steps (a fit's own plus the model's optimizer iterations before it) from which
# `auto` turns XLA on: an XLA compilation of a small model's group takes about a second on
# a CPU, and saves ~0.14 ms a step (the measurement in the module docstring).
AUTO_AFTER_STEPS = int(os.environ.get("KERAS_ACCEL_TF_XLA_AFTER", "2000"))

# The layers whose models' steps were measured faster with XLA on a CPU than without
# (docs/accelerator.md, "TensorFlow with XLA"); a model with any other layer keeps Keras's
# choice. Dropout and noise layers draw random numbers, slow in XLA on a CPU; convolutions
# took 74 times as long (the seed CNN at width 0.25, batch 256).
MEASURED_FASTER: tuple[type, ...] = (
    keras.layers.InputLayer,
    keras.layers.Dense,
    keras.layers.BatchNormalization,
    keras.layers.Activation,
    keras.layers.Flatten,
)

# Models that ran with `auto`'s XLA: their later calls keep it.
_AUTO: weakref.WeakSet = weakref.WeakSet()
_NOTED: weakref.WeakSet = weakref.WeakSet()
_WITHOUT_NOTED: list[bool] = []


def enabled() -> bool:
    return os.environ.get("KERAS_ACCEL_TF_XLA", "1") != "0"


def measured_faster(model) -> bool:
    """Whether `model` is one of Keras's own model classes (a user's subclass may compute
    anything in its `call` or its steps) made only of `MEASURED_FASTER` layers."""
    from keras_accel.utils import keras_internals

    if not type(model).__module__.startswith("keras."):
        return False
    kinds = (keras.Model, *MEASURED_FASTER)
    for layer in keras_internals.flatten_layers(model, include_self=False):
        if type(layer) not in kinds and not (
            isinstance(layer, keras.Model) and type(layer).__module__.startswith("keras.")
        ):
            return False
    return True


def prior_steps(model) -> int:
    optimizer = getattr(model, "optimizer", None)
    iterations = getattr(optimizer, "iterations", None)
    return 0 if iterations is None else int(iterations.numpy())


@contextlib.contextmanager
def auto(model, one_cpu: bool, call_steps: int | None, groups, verbose, training: bool, on_first):
    """For the duration of the block, `model.jit_compile` True where `auto` (the module
    docstring) chooses XLA for this call. `one_cpu`: the Accelerator runs one CPU device;
    `call_steps`: the steps this call runs (None: unknown), counted with the model's
    training so far where the call trains (an evaluation counts its own steps only);
    `groups()`: whether the call's batches, with XLA on, are read a group at a time;
    `on_first()`: called where a model's steps turn to XLA. Yields whether it turned XLA on."""
    chosen = (
        enabled()
        and one_cpu
        and model.jit_compile is False
        and not getattr(model, "run_eagerly", False)
        and (
            model in _AUTO  # Its steps compiled with XLA already.
            or call_steps is not None
            and measured_faster(model)
            and call_steps + (prior_steps(model) if training else 0) >= AUTO_AFTER_STEPS
        )
    )
    if not chosen:
        yield False
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's "Model doesn't support jit_compile=True".
        model.jit_compile = True  # Keras's public setter: it checks the model's support.
    try:
        if model.jit_compile is not True or (model not in _AUTO and not groups()):
            yield False
            return
        if model not in _AUTO:
            _AUTO.add(model)
            _note(model, verbose)
            on_first()
        yield True
    finally:
        model.jit_compile = False


def _note(model, verbose) -> None:
    if not verbose or model in _NOTED:
        return
    _NOTED.add(model)
    from keras_accel.utils.printing import print_msg

    print_msg(
        f"keras_accel: {model.name!r} runs its steps with XLA on this CPU (Keras leaves it "
        "off on CPUs; measured faster for this kind of model, with the same results up to "
        "float rounding). KERAS_ACCEL_TF_XLA=0 keeps the model's jit_compile."
    )


def without_xla(patches, model) -> None:
    """`compile(jit_compile=True)` under a MirroredStrategy over several CPU devices: the
    call runs its steps as plain `tf.function`s. TensorFlow places every replica's XLA
    cluster on the first CPU device, which then reads the other replicas' variables ("Trying
    to access resource ... located in device CPU:1 from device CPU:0"): raw Keras fails
    there too. Keras itself turns XLA off where it cannot run (`model_supports_jit`); the
    numbers are the same, and the model keeps `jit_compile=True` after the call."""
    if not model.jit_compile:
        return
    if not _WITHOUT_NOTED:
        _WITHOUT_NOTED.append(True)
        from keras_accel.adapter.feeder import user_stacklevel

        warnings.warn(
            "keras_accel: jit_compile=True does not run under TensorFlow's MirroredStrategy "
            "over several CPU devices (TensorFlow places every replica's XLA program on the "
            "first device); the steps run without XLA, with the same results. On JAX every "
            "step is compiled with XLA.",
            stacklevel=user_stacklevel(),
        )
    # `jit_compile` is Keras's public property (its setter checks support): set and put back.
    model.jit_compile = False
    patches.add(lambda: setattr(model, "jit_compile", True))
