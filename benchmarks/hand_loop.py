"""A training loop written by hand in each backend's own idiom, against `Accelerator.fit`,
plain `model.fit` and `model.fit` with `steps_per_execution=32`: per-epoch times side by side.

The hand loops hold no Keras in the timed loop:

- JAX: parameters as a pytree, Adam written out (optax is not a dependency), a `jax.jit`-ed
  `lax.scan` over groups of 32 steps, the state donated;
- TensorFlow: `tf.Variable`s, Adam written out, a `tf.function` whose `tf.range` loop (a
  `tf.while_loop`) runs 32 steps per call, with XLA (`jit_compile=True`) and without;
- torch: `torch.nn.Sequential` and `torch.optim.Adam`, eager, one step per Python iteration,
  and the same step function under `torch.compile` (left out, with its reason, if that fails).

Each hand loop starts from the same Glorot-uniform weights as Keras's defaults, takes the
data as the backend's own tensors made once before timing and slices one batch per step
(no shuffling); each computes the loss (softmax cross-entropy on logits, the same function
as Keras's categorical cross-entropy on the softmax), not the accuracy. The Keras models
compile Adam(1e-3), categorical cross-entropy and accuracy (on TensorFlow once more with
`jit_compile=True`, which Keras's "auto" leaves off on CPUs), and are fitted with
`batch_size`, `epochs=2`, `verbose=0` and Keras's other defaults (so Keras shuffles each
epoch; `--no-shuffle` passes `shuffle=False` for a like-for-like comparison). A Keras
contestant's epoch is its second epoch of the call, timed by a callback from its start to
its end, as a training run of many epochs spends its time; what the call took besides two
such epochs (the call's setup: its data pipeline and first iterator, Keras's callbacks and
history) is its own column, the fixed cost of one `fit` call.

Cases: `dense@64`, Dense 64 relu -> Dense 10 softmax on 32 features at batch 64 (1,024 steps
per epoch); `mlp@256`, the library's seed MLP (`keras_accel.models.mlp`: eight blocks Dense ->
BatchNorm -> ReLU -> Dropout(0.5) on (32, 32, 3) images) at batch 256 (64 steps per epoch),
whose hand loops rebuild those layers; `cnn@256`, the seed CNN (`keras_accel.models.cnn`:
five Conv2D -> BatchNorm -> ReLU blocks, two average poolings) at batch 256, 4 steps per
epoch, with no hand loop: its Keras contestants against plain `model.fit` (the reference
there), and on TensorFlow without the `jit_compile=True` rows (XLA's convolutions on a CPU
take minutes a step at this size; docs/benchmarks.md).

Every backend runs in its own child process, with that backend's default thread settings,
the same for every contestant (all run in that one process). The child builds everything,
runs one warm-up call of every contestant (compilation; `--warmup N` for more), then times
one epoch of each in turn, `--rounds` times, so that machine noise hits all alike, and
reports the medians. A contestant whose first timed epoch took over twice its median is named under
the table: it was still compiling (acc.fit on torch compiles its step only after 2,000 eager
steps, and on dense@64 took about five epochs to settle here).

    python benchmarks/hand_loop.py --backends jax,tensorflow,torch
    python benchmarks/hand_loop.py --backends jax,tensorflow,torch --case dense@64,mlp@256
    python benchmarks/hand_loop.py --backends torch --warmup 5
    python benchmarks/hand_loop.py --case cnn@256 --rounds 3 --warmup 1

Prints one Markdown table per case; its ratio column is the reference hand loop's time over
the contestant's (>1: the contestant is faster). The reference is the scan on JAX, the XLA
while loop on TensorFlow and the eager loop on torch (the idiom). `--json PATH` also writes
every figure.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (model, batch size, training rows)
CASES = {
    "dense@64": ("dense", 64, 64 * 1024),
    "mlp@256": ("mlp", 256, 256 * 64),
    "cnn@256": ("cnn", 256, 256 * 4),  # No hand loop: the Keras contestants only.
}
GROUP = 32  # Steps per host call of the JAX and TensorFlow hand loops.
# Keras's defaults, which the hand loops copy: Adam's and BatchNormalization's.
LEARNING_RATE, BETA_1, BETA_2, ADAM_EPSILON = 1e-3, 0.9, 0.999, 1e-7
BN_MOMENTUM, BN_EPSILON = 0.99, 1e-3
REFERENCE = {
    "jax": "hand: jit(lax.scan), 32 steps/call",
    "tensorflow": "hand: tf.function XLA while, 32 steps/call",
    "torch": "hand: eager, 1 step/iteration",
}
TORCH_REFUSED = "refused (Keras's torch trainer runs one step per call)"


@dataclass(frozen=True)
class Spec:
    """The hand loops' model: hidden Dense layers (with or without BatchNorm and Dropout),
    ReLU after each, then a 10-way softmax."""

    input_shape: tuple[int, ...]
    hidden: tuple[int, ...]
    batchnorm: bool
    dropout: float
    classes: int = 10

    @property
    def features(self) -> int:
        n = 1
        for d in self.input_shape:
            n *= d
        return n


def _spec(kind: str) -> Spec:
    if kind == "dense":
        return Spec((32,), (64,), batchnorm=False, dropout=0.0)
    if kind == "cnn":  # Its input's shape only: no hand loop builds it.
        return Spec((32, 32, 3), (), batchnorm=True, dropout=0.0)
    from keras_accel.models.seed import MLP_UNITS

    return Spec((32, 32, 3), tuple(MLP_UNITS), batchnorm=True, dropout=0.5)


def _initial_weights(spec: Spec, rng) -> tuple[list[dict], list[tuple]]:
    """Glorot-uniform kernels and zero biases (Keras's Dense defaults), BatchNorm's gamma 1 and
    beta 0, and its moving statistics (mean 0, variance 1), as numpy arrays: every hand loop
    starts from the same weights."""
    import numpy as np

    sizes = [spec.features, *spec.hidden, spec.classes]
    layers, stats = [], []
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        layer = {
            "kernel": rng.uniform(-limit, limit, (fan_in, fan_out)).astype("float32"),
            "bias": np.zeros(fan_out, "float32"),
        }
        if spec.batchnorm and i < len(spec.hidden):
            layer["gamma"] = np.ones(fan_out, "float32")
            layer["beta"] = np.zeros(fan_out, "float32")
            stats.append((np.zeros(fan_out, "float32"), np.ones(fan_out, "float32")))
        layers.append(layer)
    return layers, stats


# ---------------------------------------------------------------------------------- JAX


def jax_hand_loops(spec: Spec, x_np, y_np, batch: int, weights) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    x, y = jax.device_put(x_np), jax.device_put(y_np)  # Once, before timing: the idiom.
    steps = len(x_np) // batch
    group = min(GROUP, steps)
    rate = spec.dropout

    def loss_fn(params, stats, xb, yb, key):
        h = xb.reshape(batch, -1)
        new_stats = []
        for i, layer in enumerate(params[:-1]):
            h = h @ layer["kernel"] + layer["bias"]
            if spec.batchnorm:
                mean, var = h.mean(0), h.var(0)
                h = (h - mean) * lax.rsqrt(var + BN_EPSILON) * layer["gamma"] + layer["beta"]
                old_mean, old_var = stats[i]
                mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
                new_stats.append(
                    (
                        old_mean * BN_MOMENTUM + mean * (1 - BN_MOMENTUM),
                        old_var * BN_MOMENTUM + var * (1 - BN_MOMENTUM),
                    )
                )
            h = jax.nn.relu(h)
            if rate:
                keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, h.shape)
                h = jnp.where(keep, h / (1 - rate), 0.0)
        logits = h @ params[-1]["kernel"] + params[-1]["bias"]
        loss = -jnp.mean(jnp.sum(yb * jax.nn.log_softmax(logits), axis=-1))
        return loss, new_stats

    def adam(params, grads, m, v, t):
        # Keras's Adam: the bias corrections folded into the learning rate.
        lr = LEARNING_RATE * jnp.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
        m = jax.tree.map(lambda m, g: m + (g - m) * (1 - BETA_1), m, grads)
        v = jax.tree.map(lambda v, g: v + (g * g - v) * (1 - BETA_2), v, grads)
        params = jax.tree.map(
            lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM_EPSILON), params, m, v
        )
        return params, m, v

    def run_group(state, x, y, first):
        def step(state, i):
            key, step_key = jax.random.split(state["key"])
            xb = lax.dynamic_slice_in_dim(x, i * batch, batch)
            yb = lax.dynamic_slice_in_dim(y, i * batch, batch)
            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                state["params"], state["stats"], xb, yb, step_key
            )
            t = state["t"] + 1
            params, m, v = adam(state["params"], grads, state["m"], state["v"], t)
            return {"params": params, "stats": stats, "m": m, "v": v, "t": t, "key": key}, loss

        state, losses = lax.scan(step, state, first + jnp.arange(group))
        return state, losses.sum()

    # The state is donated: XLA updates the weights in place, as a training loop should.
    run_group = jax.jit(run_group, donate_argnums=0)
    layers, stats = weights
    params = jax.device_put(layers)
    state = {
        "params": params,
        "stats": jax.device_put(stats),
        "m": jax.tree.map(jnp.zeros_like, params),
        "v": jax.tree.map(jnp.zeros_like, params),
        "t": jnp.zeros((), "float32"),
        "key": jax.random.PRNGKey(0),
    }

    def epoch() -> float:
        nonlocal state
        losses = []
        for first in range(0, steps, group):
            state, loss = run_group(state, x, y, first)
            losses.append(loss)
        return float(np.sum(jax.device_get(losses))) / steps  # Waits for the device.

    return {REFERENCE["jax"]: epoch}


# ---------------------------------------------------------------------------- TensorFlow


class _TFHandLoop:
    """tf.Variables, Adam written out, a `tf.function` running `group` steps per call."""

    def __init__(self, spec: Spec, x, y, batch: int, steps: int, weights, jit_compile: bool):
        import tensorflow as tf

        layers, stats = weights
        self.spec, self.x, self.y, self.batch, self.steps = spec, x, y, batch, steps
        self.group = min(GROUP, steps)
        self.layers = [{k: tf.Variable(v) for k, v in layer.items()} for layer in layers]
        self.stats = [(tf.Variable(m), tf.Variable(v)) for m, v in stats]
        self.trainable = [v for layer in self.layers for v in layer.values()]
        self.m = [tf.Variable(tf.zeros_like(v)) for v in self.trainable]
        self.v = [tf.Variable(tf.zeros_like(v)) for v in self.trainable]
        self.iterations = tf.Variable(0, dtype=tf.int64)
        # Group starts made once, as tensors: a Python int argument would retrace per value.
        self.starts = [tf.constant(s, tf.int32) for s in range(0, steps, self.group)]
        self.run_group = tf.function(self._group, jit_compile=jit_compile)

    def _forward(self, xb, training_seed):
        import tensorflow as tf

        h = tf.reshape(xb, (self.batch, -1))
        for i, layer in enumerate(self.layers[:-1]):
            h = h @ layer["kernel"] + layer["bias"]
            if self.spec.batchnorm:
                mean, var = tf.nn.moments(h, axes=[0])
                h = tf.nn.batch_normalization(
                    h, mean, var, layer["beta"], layer["gamma"], BN_EPSILON
                )
                moving_mean, moving_var = self.stats[i]
                moving_mean.assign(moving_mean * BN_MOMENTUM + mean * (1 - BN_MOMENTUM))
                moving_var.assign(moving_var * BN_MOMENTUM + var * (1 - BN_MOMENTUM))
            h = tf.nn.relu(h)
            if self.spec.dropout:
                # Stateless: the seed (step, layer) is a tensor, so XLA compiles it once.
                seed = tf.stack([training_seed, tf.constant(i, tf.int64)])
                h = tf.nn.experimental.stateless_dropout(h, self.spec.dropout, seed)
        return h @ self.layers[-1]["kernel"] + self.layers[-1]["bias"]

    def _rows(self, data, i):
        """Step `i`'s batch: `tf.slice` with a constant size, so that XLA sees a static
        shape (a `data[start:stop]` slice with tensor bounds does not have one under XLA)."""
        import tensorflow as tf

        begin = tf.concat([[i * self.batch], tf.zeros(len(data.shape) - 1, tf.int32)], 0)
        return tf.slice(data, begin, [self.batch, *data.shape[1:]])

    def _step(self, i):
        import tensorflow as tf

        xb, yb = self._rows(self.x, i), self._rows(self.y, i)
        with tf.GradientTape() as tape:
            logits = self._forward(xb, self.iterations.read_value())
            loss = tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(yb, logits))
        grads = tape.gradient(loss, self.trainable)
        self.iterations.assign_add(1)
        t = tf.cast(self.iterations, tf.float32)
        lr = LEARNING_RATE * tf.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
        for var, g, m, v in zip(self.trainable, grads, self.m, self.v):
            m.assign_add((g - m) * (1 - BETA_1))
            v.assign_add((g * g - v) * (1 - BETA_2))
            var.assign_sub(lr * m / (tf.sqrt(v) + ADAM_EPSILON))
        return loss

    def _group(self, first):
        import tensorflow as tf

        total = tf.constant(0.0)
        for i in tf.range(first, first + self.group):  # Autograph: a tf.while_loop.
            total += self._step(i)
        return total

    def epoch(self) -> float:
        total = 0.0
        for first in self.starts:
            total += self.run_group(first)
        return float(total) / self.steps  # Waits for the device.


def tensorflow_hand_loops(spec: Spec, x_np, y_np, batch: int, weights) -> dict:
    import tensorflow as tf

    x, y = tf.constant(x_np), tf.constant(y_np)  # Once, before timing: the idiom.
    steps = len(x_np) // batch
    xla = _TFHandLoop(spec, x, y, batch, steps, weights, jit_compile=True)
    plain = _TFHandLoop(spec, x, y, batch, steps, weights, jit_compile=False)
    return {
        REFERENCE["tensorflow"]: xla.epoch,
        "hand: tf.function while, no XLA, 32 steps/call": plain.epoch,
    }


# --------------------------------------------------------------------------------- torch


def torch_hand_loops(spec: Spec, x_np, y_np, batch: int, weights) -> dict:
    import torch
    from torch import nn

    x, y = torch.from_numpy(x_np), torch.from_numpy(y_np)  # Once, before timing.
    steps = len(x_np) // batch

    def build():
        modules = [nn.Flatten()] if len(spec.input_shape) > 1 else []
        sizes = [spec.features, *spec.hidden]
        for fan_in, units in zip(sizes[:-1], sizes[1:]):
            modules.append(nn.Linear(fan_in, units))
            if spec.batchnorm:
                # torch's momentum is the new batch's share: Keras's 0.99 is torch's 0.01.
                modules.append(nn.BatchNorm1d(units, eps=BN_EPSILON, momentum=1 - BN_MOMENTUM))
            modules.append(nn.ReLU())
            if spec.dropout:
                modules.append(nn.Dropout(spec.dropout))
        modules.append(nn.Linear(sizes[-1], spec.classes))
        model = nn.Sequential(*modules)
        # The same starting weights as the other hand loops (torch keeps kernels transposed).
        linears = [m for m in model if isinstance(m, nn.Linear)]
        norms = [m for m in model if isinstance(m, nn.BatchNorm1d)]
        with torch.no_grad():
            for module, layer in zip(linears, weights[0]):
                module.weight.copy_(torch.from_numpy(layer["kernel"].T))
                module.bias.copy_(torch.from_numpy(layer["bias"]))
        assert len(norms) == (len(spec.hidden) if spec.batchnorm else 0)
        model.train()
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE, eps=ADAM_EPSILON)
        # Soft (one-hot) targets: cross-entropy on the logits, as Keras's on the softmax.
        loss_fn = nn.CrossEntropyLoss()

        def train_step(xb, yb):
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            return loss.detach()

        return train_step

    def epoch_of(train_step):
        def epoch() -> float:
            total = torch.zeros(())
            for i in range(steps):
                total += train_step(x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch])
            return float(total) / steps

        return epoch

    return {
        REFERENCE["torch"]: epoch_of(build()),
        "hand: torch.compile(step), 1 step/iteration": epoch_of(torch.compile(build())),
    }


HAND_LOOPS = {
    "jax": jax_hand_loops,
    "tensorflow": tensorflow_hand_loops,
    "torch": torch_hand_loops,
}

# --------------------------------------------------------------------------------- child


def _threads(backend: str) -> str:
    """The thread settings every contestant of this process shares (the defaults)."""
    if backend == "torch":
        import torch

        return (
            f"torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}"
        )
    if backend == "tensorflow":
        import tensorflow as tf

        intra = tf.config.threading.get_intra_op_parallelism_threads()
        inter = tf.config.threading.get_inter_op_parallelism_threads()
        return f"TF intra-op {intra or 'default'}, inter-op {inter or 'default'}"
    return f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '') or 'default'}"


KERAS_DISPATCH = {
    "jax": "acc.fit, every batch hook dispatched (Keras's CallbackList)",
    "tensorflow": "acc.fit, jit_compile=True, every batch hook dispatched (Keras's CallbackList)",
    "torch": "acc.fit, every batch hook dispatched (Keras's CallbackList)",
}


def _with_keras_callback_list(fit, model, timer):
    """`fit(model, timer)` with the callbacks handed to Keras as a list, so that Keras makes
    its own CallbackList (every batch hook dispatched), as before keras_accel's own list."""
    from unittest import mock

    from keras_accel.adapter import callback_list

    def as_given(model, callbacks, data, **kwargs):
        return callbacks

    with mock.patch.object(callback_list, "for_call", as_given):
        return fit(model, timer)


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    from keras_accel import Accelerator
    from keras_accel.models import cnn, compile_seed, mlp

    acc = Accelerator(seed=0)
    kind, batch, rows = CASES[args.case]
    spec = _spec(kind)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, *spec.input_shape)).astype("float32")
    y = keras.utils.to_categorical(rng.integers(0, 10, rows), 10).astype("float32")
    steps = rows // batch
    assert steps % min(GROUP, steps) == 0, "the hand loops run whole groups of steps"
    fit_kwargs = {"batch_size": batch, "verbose": 0}
    if not args.shuffle:
        fit_kwargs["shuffle"] = False

    def build(**compile_kwargs):
        if kind == "mlp":
            return compile_seed(mlp(input_shape=spec.input_shape, num_classes=10), **compile_kwargs)
        if kind == "cnn":
            return compile_seed(cnn(input_shape=spec.input_shape, num_classes=10), **compile_kwargs)
        model = keras.Sequential(
            [
                keras.Input(spec.input_shape),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
        model.compile(
            keras.optimizers.Adam(LEARNING_RATE),
            "categorical_crossentropy",
            metrics=["accuracy"],
            **compile_kwargs,
        )
        return model

    class EpochTimes(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.began = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.began)

    def keras_epoch(fit, model):
        # Two epochs in one call: the second is the steady epoch (the first holds the
        # call's setup: its pipeline, its first iterator); what the call took besides two
        # steady epochs is its fixed cost.
        def epoch() -> tuple[float, float, float]:
            timer = EpochTimes()
            timer.times = []
            started = time.perf_counter()
            loss = fit(model, timer)["loss"][-1]
            call = time.perf_counter() - started
            return loss, timer.times[1], call - 2 * timer.times[1]

        return epoch

    def fitted(fit_of):
        return lambda m, timer: fit_of(m)(x, y, epochs=2, callbacks=[timer], **fit_kwargs).history

    with acc.scope():
        accelerated = build()
    hand = kind != "cnn"
    runs = HAND_LOOPS[acc.backend](spec, x, y, batch, _initial_weights(spec, rng)) if hand else {}
    accelerated_fit = fitted(lambda m: functools.partial(acc.fit, m))
    runs["acc.fit"] = keras_epoch(accelerated_fit, accelerated)
    # Keras's "auto" leaves XLA off on TensorFlow on CPUs; `acc.fit` turns it on for the
    # dense model (a fit of 2,000 steps or more), not for the seed MLP's Dropout layers.
    if acc.backend == "tensorflow" and hand:
        with acc.scope():
            xla = build(jit_compile=True)
        runs["acc.fit, jit_compile=True"] = keras_epoch(accelerated_fit, xla)
    # What skipping the batch hooks no callback implements saves (keras_accel.adapter.
    # callback_list): the same call with Keras's own CallbackList, which dispatches them.
    if hand:
        with acc.scope():
            dispatched = build(jit_compile=True) if acc.backend == "tensorflow" else build()
        runs[KERAS_DISPATCH[acc.backend]] = keras_epoch(
            lambda m, timer: _with_keras_callback_list(accelerated_fit, m, timer), dispatched
        )
    plain_fit = fitted(lambda m: m.fit)
    runs["model.fit"] = keras_epoch(plain_fit, build())
    runs["model.fit, steps_per_execution=32"] = keras_epoch(
        plain_fit, build(steps_per_execution=32)
    )
    if acc.backend == "tensorflow" and hand:
        runs["model.fit, steps_per_execution=32, jit_compile=True"] = keras_epoch(
            plain_fit, build(steps_per_execution=32, jit_compile=True)
        )

    left_out = {}
    for name, run in list(runs.items()):  # Warm-up: compilation, `--warmup` epochs each.
        try:
            for _ in range(args.warmup):
                run()
        except Exception as error:  # noqa: BLE001 - any failure leaves the row out, said why.
            del runs[name]
            if acc.backend == "torch" and name.startswith("model.fit, steps_per_execution"):
                left_out[name] = TORCH_REFUSED if isinstance(error, ValueError) else repr(error)
            else:
                left_out[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
            print(f"{name}: left out: {left_out[name]}", file=sys.stderr)
    times = {name: [] for name in runs}
    call_costs = {name: [] for name in runs}
    losses = {}
    for _ in range(args.rounds):
        for name, run in runs.items():  # In turn: noise hits every contestant alike.
            started = time.perf_counter()
            result = run()
            if isinstance(result, tuple):  # A Keras fit: its steady epoch, timed inside.
                losses[name], seconds, call_cost = result
                call_costs[name].append(call_cost)
            else:  # A hand loop: one epoch is the call.
                losses[name], seconds = result, time.perf_counter() - started
            times[name].append(seconds)
    medians = {name: statistics.median(t) for name, t in times.items()}
    reference = REFERENCE[acc.backend] if hand else "model.fit"
    ref_s = medians.get(reference)
    return {
        "backend": acc.backend,
        "case": args.case,
        "steps": steps,
        "batch_size": batch,
        "shuffle": args.shuffle,
        "threads": _threads(acc.backend),
        "reference": reference,
        "contestants": [
            {
                "name": name,
                "s_per_epoch": medians[name],
                "times": times[name],
                "call_cost_s": statistics.median(call_costs[name]) if call_costs[name] else None,
                "last_loss": losses[name],
                "ratio": ref_s / medians[name] if ref_s else None,
            }
            for name in runs
        ],
        "left_out": left_out,
    }


# -------------------------------------------------------------------------------- parent


def _table(case: str, rows: list[dict]) -> None:
    kind, batch, samples = CASES[case]
    print(f"\n### {case}: batch {batch}, {samples // batch} steps per epoch\n")
    print(
        "| backend | contestant | s/epoch (median) | hand loop / contestant "
        "| fit call's fixed cost s |"
    )
    print("|---|---|---|---|---|")
    notes = []
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} | | |")
            continue
        for c in row["contestants"]:
            ratio = f"{c['ratio']:.2f}x" if c["ratio"] else "n/a"
            cost = "" if c.get("call_cost_s") is None else f"{c['call_cost_s']:.3f}"
            print(f"| {row['backend']} | {c['name']} | {c['s_per_epoch']:.3f} | {ratio} | {cost} |")
            if c["times"][0] > 2 * c["s_per_epoch"]:
                # Still compiling after the warm-up: the median hides it only with rounds.
                notes.append(
                    f"{row['backend']}: {c['name']}'s first timed epoch took "
                    f"{c['times'][0]:.2f} s, over twice its median: not warm yet (raise --warmup)"
                )
        for name, why in row["left_out"].items():
            if why == TORCH_REFUSED:
                print(f"| {row['backend']} | {name} | {why} | |")
            else:
                notes.append(f"{row['backend']}: {name} left out: {why}")
        notes.append(f"{row['backend']}: reference = {row['reference']}; {row['threads']}")
    print()
    for note in notes:
        print(f"- {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument("--case", default="dense@64", help=f"comma-separated: {', '.join(CASES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed epochs of each contestant first (compilation); acc.fit on torch "
        "compiles its step only after 2,000 eager steps, so it needs more to be warm",
    )
    parser.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="fit the Keras models with shuffle=False, as the hand loops read the rows",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    cases = args.case.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: {list(CASES)}")
    common = [f"--rounds={args.rounds}", f"--warmup={args.warmup}"] + (
        [] if args.shuffle else ["--no-shuffle"]
    )
    results = {}
    for case in cases:
        results[case] = []
        for backend in args.backends.split(","):
            row = run_child(
                os.path.join(HERE, "hand_loop.py"), backend, [*common, f"--case={case}"]
            )
            results[case].append({"case": case, **row} if "error" in row else row)
    for case, rows in results.items():
        _table(case, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row for rows in results.values() for row in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
