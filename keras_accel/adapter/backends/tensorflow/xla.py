"""TensorFlow: where a call's steps run without XLA although the model was compiled with it.

Under a MirroredStrategy over several CPU devices a model compiled with `jit_compile=True`
runs its steps as plain `tf.function`s (`without_xla`). Where XLA runs a model's steps on
one device, and where not, is decided by measuring both (`keras_accel.adapter.choice`,
`fused.GroupRunner`).
"""

from __future__ import annotations

import warnings

_WITHOUT_NOTED: list[bool] = []


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
