"""The adapter: maps one Keras script onto the backend's own distribution.

JAX: a `keras.distribution` over a device mesh; TensorFlow: a `tf.distribute` strategy;
torch: one process per device, joined in a `torch.distributed` process group (gloo on CPUs,
NCCL on GPUs), the gradients averaged over it.

Its core (plan, runtime, feeder, session, steps) sits below `Accelerator` and `acc.loop`,
which build on it; `keras_accel.Accelerator` is the public name.
"""
