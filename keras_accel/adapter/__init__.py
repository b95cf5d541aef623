"""The adapter: maps one Keras script onto JAX device meshes or tf.distribute strategies.

Its core (plan, runtime, feeder, session, steps) sits below `Accelerator` and `acc.loop`,
which build on it; `keras_accel.Accelerator` is the public name.
"""
