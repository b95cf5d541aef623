"""The adapter: maps one Keras script onto the backend's own distribution.

JAX: a `keras.distribution` over a device mesh; TensorFlow: a `tf.distribute` strategy;
torch: one process per device, joined in a `torch.distributed` process group (gloo on CPUs,
NCCL on GPUs), the gradients averaged over it.

Its core sits below `Accelerator` (`accelerator.py`, the facade) and `acc.loop`, which build
on it; `keras_accel.Accelerator` is the public name. The facade tells each call in order,
each stage in its own module:

1. `placement`: the model checked (a `keras.Model`, built and compiled in the scope);
2. `inputs`: its inputs standardized and checked (text targets, `validation_split`);
3. `batches`: batched by the `feeder` into static batches, padding kept exact
   (`exactness` probes compiled losses and metrics, `unweighted` reads the model's own
   code) or the last batch dropped with a note, or refused;
4. `fusion`: how many steps run per host call;
5. `run`: wrapped for the backend's steps and run in Keras's own call, inside a `session`
   (what the call installs, `patches`, undone after it; the step wrappers of `steps`),
   the step's way chosen by measuring it (`choice`, remembered by `choice_cache`).

Under them: `strategies` (the registry of strategy names, and the plan), `runtime` (the
contract every backend's runtime keeps) and `backends/` (one per backend, imported
lazily), `protocol` (what callbacks and the run share: `RunContext`), `guard` (the
recompile guard), `batchnorm`, `layouts` (`Accelerator.describe`), `loss_weights`,
`pipeline` (keras-hub tasks), `callback_list`, `sharding`.
"""
