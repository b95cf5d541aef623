"""A basket of models, each trained by a loop written by hand in each backend's own idiom, against
`Accelerator.fit`, plain `model.fit` and `model.fit(steps_per_execution=32)`: per-epoch times.

Cases (`--case`, comma-separated; `basket`, the default, is the first six):

- `dense@64`: Dense 64 relu -> Dense 10 softmax on 32 features, batch 64, 1,024 steps an epoch;
- `dropout@64`: the same with Dropout(0.2) after the hidden layer, batch 64, 1,024 steps;
- `text@64`: a small text classifier, 32 int tokens from a 1,000-word vocabulary -> Embedding
  (1,000, 32) -> GlobalAveragePooling1D (the mean over tokens) -> Dense 64 relu ->
  LayerNormalization -> Dense 10 softmax, batch 64, 512 steps;
- `cnn@32`: the seed CNN (`keras_accel.models.cnn`: five Conv2D -> BatchNorm -> ReLU blocks,
  two average poolings) on (32, 32, 3) images, batch 32, 4 steps;
- `bert@32`: a small Transformer encoder, keras-hub's `BertBackbone` built from a tiny config
  (2 layers, 2 heads, hidden 32, intermediate 64, vocabulary 1,000, 32 tokens; its dropout
  0.1; no preset, nothing downloaded) -> its pooled output -> Dense 10 softmax, batch 32, 64 steps;
- `lstm@64`: 32 int tokens -> Embedding(1,000, 32) -> LSTM(32) -> Dense 10 softmax, batch 64,
  64 steps;
- outside the basket: `mlp@256`, the seed MLP (`keras_accel.models.mlp`: eight blocks Dense
  -> BatchNorm -> ReLU -> Dropout(0.5) on (32, 32, 3) images) at batch 256, 64 steps; and
  `cnn@256`, the seed CNN at batch 256, 4 steps (2-4 s a step on this 2-core CPU).

The hand loops, a pair per backend, the best a user would write there (the faster of the pair,
in each mode's run, is the reference):

- JAX: a `jax.jit`-ed `lax.scan` over groups of 32 steps (an epoch's steps when fewer), and
  the same step `jax.jit`-ed alone, one step per call; the state donated, Adam written out
  (optax is not a dependency);
- TensorFlow: a `tf.function` whose `tf.range` loop (a `tf.while_loop`) runs 32 steps per call,
  Adam written out on the variables, with XLA (`jit_compile=True`) and without;
- torch: `torch.optim.Adam`, one step per Python iteration, eager and the same step function
  under `torch.compile`.

For `dense@64`, `dropout@64` and `mlp@256` the hand loops hold no Keras at all (parameters as
a pytree, `tf.Variable`s, `torch.nn.Sequential`). For the other models they use the Keras
model's layers as that backend's functions, as Keras's guides to writing a training loop from
scratch do: JAX `model.stateless_call` inside the jitted step, TensorFlow `model(x,
training=True)` under a `tf.GradientTape` inside the `tf.function`, torch the Keras model as the
`torch.nn.Module` it is, `torch.optim.Adam(model.parameters())`. The loop itself (batching,
stepping, the optimizer) is written by hand; no Keras `fit` in it. A contestant that fails
(e.g. `torch.compile` on some model) is left out with its reason under the table.

The CNN cases leave out, unless `--cnn-xla`, the hand loops that run their steps in an XLA
while loop: JAX's scan and TensorFlow's XLA hand loop. XLA:CPU (JAX 0.10.2, TF 2.21) runs a
convolution's kernel gradient inside a while loop about 100 times as slowly as outside one (one
Conv2D 96 -> 256 at batch 32 on 16x16, 4 steps: 31 s in a `lax.scan` against 0.33 s unrolled;
30 s in a TF XLA while loop against 0.31 s as 4 XLA calls); the seed CNN's epoch at batch 32
took 135 s in JAX's scan against 2.6 s for Keras's jitted step. The Keras contestants run:
Keras's `fit(steps_per_execution=32, jit_compile=True)` launches one XLA program per step, and
`acc.fit` measures a group as one program (an XLA while loop, a scan) against a call per step.
A contestant whose steady call (not its first in the mode, or a long fit's second epoch) took
over `--max-call-s` (60 s) is not called again: that call is its last figure, said so under
the table.

The same model everywhere in a case: every contestant, hand loop or Keras, starts from the same
weights (one Keras model's initial weights, copied), and computes Keras's categorical
cross-entropy on the softmax (the hand loops without Keras take it on the logits, the same
function). The Keras models compile Adam(1e-3), categorical cross-entropy and accuracy (the
hand loops compute the loss, not the accuracy) and are fitted with `batch_size`, `verbose=0`
and Keras's other defaults (so Keras shuffles each epoch; `--no-shuffle` passes
`shuffle=False`, as the hand loops read the rows in order). The hand loops take the data as the
backend's own tensors, made once before timing, and slice one batch per step.

The Keras contestants: `acc.fit` (keras_accel's Accelerator), plain `model.fit` and
`model.fit` after `compile(steps_per_execution=32)` (Keras's torch trainer refuses it: its row
says so); on TensorFlow `acc.fit` and the latter once more with `jit_compile=True` (Keras's
"auto" leaves XLA off on CPUs). `--dispatch` adds, in the long mode, `acc.fit` with the
callbacks handed to Keras as a list (Keras's own CallbackList, every batch hook dispatched).

Two modes (`--mode`, both by default), each its own table:

- `long`: one long call. A Keras contestant's epoch is the second epoch of a `fit(epochs=2)`
  call, timed by a callback from its start to its end, as a training run of many epochs spends
  its time; what the call took besides two such epochs (its setup: data pipeline, first
  iterator, callbacks, history) is its own column, the fixed cost of one `fit` call.
- `repeated`: `fit(epochs=1)` called again and again on the same model (a notebook, a tuner's
  trials): the whole call is timed, setup included. Its last column is each contestant's first
  call (compilation included; a hand loop's first epoch ever).

A hand loop's epoch is its steps, timed from outside, the same in both modes. Every backend
runs in its own child process, with that backend's default thread settings, the same for every
contestant (all run in that one process); `--torch-threads 1` gives torch one intra-op thread.
On this 2-core host shared with other work (load 3-4), torch's default two threads made the
dense model's `acc.fit` epoch take 2 to 30 s where one thread took 0.43 s steadily
(2026-12-07): there, run torch with `--torch-threads 1` (the threads are in the notes under
each table). In each mode the child builds the Keras models (new ones per mode), runs
`--warmup` untimed calls of every contestant (compilation, and `acc.fit`'s measured choices),
then times one epoch (one call) of each in turn, `--rounds` times, so that machine noise hits
all alike, and reports the medians. A contestant whose first timed call took over twice its
median is named under the table: it was still compiling (raise `--warmup`).

    python benchmarks/hand_loop.py --torch-threads 1      # the basket, both modes, 3 backends
    python benchmarks/hand_loop.py --case basket --torch-threads 1 --json basket.json
    python benchmarks/hand_loop.py --case dense@64 --mode long --rounds 9 --warmup 3
    python benchmarks/hand_loop.py --backends jax,tensorflow,torch --case dense@64,mlp@256
    python benchmarks/hand_loop.py --backends tensorflow,torch --case cnn@256 --rounds 2
    python benchmarks/hand_loop.py --case bert@32,lstm@64 --mode repeated --rounds 1 --warmup 1

The basket with the defaults (5 rounds after 2 warm-up calls, both modes, three backends) is
estimated at 45 to 60 minutes on this 2-core host at load 2-4 (from one round after one warm-up
call each, 2026-12-07: JAX 4.5 minutes, TensorFlow 11, torch with one thread 8; a round costs
JAX about 1 minute, TensorFlow 2.5, torch 1.5). It prints one Markdown table per case and mode;
its ratio column is the reference hand loop's time over the contestant's (>1: the contestant
is faster), the reference being that mode's fastest hand loop of the backend; the next column,
on `acc.fit`'s rows, is the faster of plain `model.fit` and
`model.fit(steps_per_execution=32)` (with the same `jit_compile`) over `acc.fit` (>= 1: never
slower than plain Keras). Then two summaries, models by backends: `acc.fit` against the best
hand loop, and against the faster plain Keras fit, each cell "long / repeated". `--json PATH`
also writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

from _child import run_child

HERE = os.path.dirname(os.path.abspath(__file__))
# name: (model, batch size, steps per epoch)
CASES = {
    "dense@64": ("dense", 64, 1024),
    "dropout@64": ("dropout", 64, 1024),
    "text@64": ("text", 64, 512),
    "cnn@32": ("cnn", 32, 4),
    "bert@32": ("bert", 32, 64),
    "lstm@64": ("lstm", 64, 64),
    "mlp@256": ("mlp", 256, 64),
    "cnn@256": ("cnn", 256, 4),
}
BASKET = ("dense@64", "dropout@64", "text@64", "cnn@32", "bert@32", "lstm@64")
MODES = ("long", "repeated")
# The hand loops with no Keras in them (the rest call the Keras model's layers).
PURE = ("dense", "dropout", "mlp")
TOKENS, VOCABULARY = 32, 1000  # The token models' sequence length and vocabulary.
GROUP = 32  # Steps per host call of the JAX and TensorFlow hand loops.
# Keras's defaults, which the hand loops copy: Adam's, BatchNormalization's, the clip of its
# cross-entropy on probabilities (`keras.config.epsilon()`).
LEARNING_RATE, BETA_1, BETA_2, ADAM_EPSILON = 1e-3, 0.9, 0.999, 1e-7
BN_MOMENTUM, BN_EPSILON = 0.99, 1e-3
CE_EPSILON = 1e-7
TORCH_REFUSED = "refused (Keras's torch trainer runs one step per call)"
# XLA:CPU (JAX 0.10.2, TF 2.21) runs a convolution's kernel gradient inside a while loop about
# 100 times as slowly as outside one: one Conv2D(96 -> 256, 3x3) at batch 32 on 16x16, 4 steps,
# 31 s in a `lax.scan` against 0.33 s unrolled, 30 s in a TF XLA while loop against 0.31 s as
# 4 XLA calls (0.27 s in TF's graph while loop). The seed CNN's epoch at batch 32 in a scan:
# 135 s against 2.6 s for Keras's jitted step (2026-12-07).
CNN_XLA = (
    "not run: XLA:CPU's convolution gradients inside a while loop take about 100 times as long "
    "as outside one (minutes an epoch here); --cnn-xla runs it"
)
CNN_SCAN = CNN_XLA.replace("a while loop", "lax.scan's while loop")
ACC = "acc.fit"
PLAIN = ("model.fit", "model.fit, steps_per_execution=32")
JIT = ", jit_compile=True"


def hand_names(backend: str, group: int) -> list[str]:
    """The hand loops' row names, the backend's pair."""
    return {
        "jax": [f"hand: jit(lax.scan), {group} steps/call", "hand: jit(step), 1 step/call"],
        "tensorflow": [
            f"hand: tf.function XLA while, {group} steps/call",
            f"hand: tf.function while, no XLA, {group} steps/call",
        ],
        "torch": ["hand: eager, 1 step/iteration", "hand: torch.compile(step), 1 step/iteration"],
    }[backend]


@dataclass(frozen=True)
class Spec:
    """The Keras-free hand loops' model: hidden Dense layers (with or without BatchNorm and
    Dropout), ReLU after each, then a 10-way softmax."""

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
    if kind == "dropout":
        return Spec((32,), (64,), batchnorm=False, dropout=0.2)
    from keras_accel.models.seed import MLP_UNITS

    return Spec((32, 32, 3), tuple(MLP_UNITS), batchnorm=True, dropout=0.5)


def _data(kind: str, rows: int, rng):
    """The case's inputs (an array, or BERT's dict of arrays) and one-hot labels."""
    import numpy as np

    if kind in ("text", "lstm", "bert"):
        tokens = rng.integers(0, VOCABULARY, (rows, TOKENS)).astype("int32")
        x = tokens
        if kind == "bert":
            x = {
                "token_ids": tokens,
                "segment_ids": np.zeros_like(tokens),
                "padding_mask": np.ones_like(tokens),
            }
    else:
        shape = (32,) if kind in ("dense", "dropout") else (32, 32, 3)
        x = rng.normal(size=(rows, *shape)).astype("float32")
    y = np.eye(10, dtype="float32")[rng.integers(0, 10, rows)]
    return x, y


def _model(kind: str):
    """A new, uncompiled Keras model of the case (random weights: callers copy the case's)."""
    import keras

    if kind == "mlp":
        from keras_accel.models import mlp

        return mlp(input_shape=(32, 32, 3), num_classes=10)
    if kind == "cnn":
        from keras_accel.models import cnn

        return cnn(input_shape=(32, 32, 3), num_classes=10)
    if kind == "bert":
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCABULARY,
            num_layers=2,
            num_heads=2,
            hidden_dim=32,
            intermediate_dim=64,
            max_sequence_length=TOKENS,
        )
        pooled = backbone(backbone.input)["pooled_output"]
        return keras.Model(backbone.input, keras.layers.Dense(10, activation="softmax")(pooled))
    if kind in ("text", "lstm"):
        body = (
            [
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(64, activation="relu"),
                keras.layers.LayerNormalization(),
            ]
            if kind == "text"
            else [keras.layers.LSTM(32)]
        )
        return keras.Sequential(
            [
                keras.Input((TOKENS,), dtype="int32"),
                keras.layers.Embedding(VOCABULARY, 32),
                *body,
                keras.layers.Dense(10, activation="softmax"),
            ]
        )
    dropout = [keras.layers.Dropout(0.2)] if kind == "dropout" else []
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(64, activation="relu"),
            *dropout,
            keras.layers.Dense(10, activation="softmax"),
        ]
    )


def _pure_weights(model) -> tuple[list[dict], list[tuple]]:
    """A Keras model's Dense kernels and biases, BatchNorm's gamma and beta and its moving
    statistics, as numpy arrays, in the layout of the Keras-free hand loops: every contestant
    of a case starts from the same weights."""
    import keras

    def numpy(variable):
        return keras.ops.convert_to_numpy(variable).copy()

    layers, stats = [], []
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layers.append({"kernel": numpy(layer.kernel), "bias": numpy(layer.bias)})
        elif isinstance(layer, keras.layers.BatchNormalization):
            layers[-1]["gamma"], layers[-1]["beta"] = numpy(layer.gamma), numpy(layer.beta)
            stats.append((numpy(layer.moving_mean), numpy(layer.moving_variance)))
    return layers, stats


def _groups(steps: int) -> int:
    group = min(GROUP, steps)
    assert steps % group == 0, "the hand loops run whole groups of steps"
    return group


# ---------------------------------------------------------------------------------- JAX


def _jax_adam(params, grads, m, v, t):
    """Keras's Adam: the bias corrections folded into the learning rate."""
    import jax
    import jax.numpy as jnp

    lr = LEARNING_RATE * jnp.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
    m = jax.tree.map(lambda m, g: m + (g - m) * (1 - BETA_1), m, grads)
    v = jax.tree.map(lambda v, g: v + (g * g - v) * (1 - BETA_2), v, grads)
    params = jax.tree.map(lambda p, m, v: p - lr * m / (jnp.sqrt(v) + ADAM_EPSILON), params, m, v)
    return params, m, v


def _jax_loops(loss_fn, params, aux, x_np, y_np, batch: int, scan: bool) -> dict:
    """The epoch functions of a jitted `lax.scan` over groups of steps (if `scan`) and of a
    jitted single step, each with its own state, donated. `loss_fn(params, aux, xb, yb, key)
    -> (loss, aux)`; `aux` is the state that is not trained (BatchNorm's statistics, Keras's
    non-trainable variables)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    x, y = jax.device_put(x_np), jax.device_put(y_np)  # Once, before timing: the idiom.
    steps = len(y_np) // batch
    group = _groups(steps)
    scanned, stepped = hand_names("jax", group)

    def step(state, x, y, i):
        key, step_key = jax.random.split(state["key"])
        xb = jax.tree.map(lambda a: lax.dynamic_slice_in_dim(a, i * batch, batch), x)
        yb = lax.dynamic_slice_in_dim(y, i * batch, batch)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state["params"], state["aux"], xb, yb, step_key
        )
        t = state["t"] + 1
        params, m, v = _jax_adam(state["params"], grads, state["m"], state["v"], t)
        return {"params": params, "aux": aux, "m": m, "v": v, "t": t, "key": key}, loss

    def run_group(state, x, y, first):
        state, losses = lax.scan(
            lambda state, i: step(state, x, y, i), state, first + jnp.arange(group)
        )
        return state, losses.sum()

    def loop(run, stride):
        # The state is donated: XLA updates the weights in place, as a training loop should.
        run = jax.jit(run, donate_argnums=0)
        state = {
            "params": jax.tree.map(jnp.array, params),  # Copies: the donated buffers are its own.
            "aux": jax.tree.map(jnp.array, aux),
            "m": jax.tree.map(jnp.zeros_like, params),
            "v": jax.tree.map(jnp.zeros_like, params),
            "t": jnp.zeros((), "float32"),
            "key": jax.random.PRNGKey(0),
        }

        def epoch() -> float:
            nonlocal state
            losses = []
            for first in range(0, steps, stride):
                state, loss = run(state, x, y, first)
                losses.append(loss)
            return float(np.sum(jax.device_get(losses))) / steps  # Waits for the device.

        return epoch

    loops = {scanned: loop(run_group, group)} if scan else {}
    loops[stepped] = loop(step, 1)
    return loops


def jax_hand_loops(spec: Spec, x_np, y_np, batch: int, weights) -> dict:
    """The Keras-free loop: parameters as a pytree."""
    import jax
    import jax.numpy as jnp
    from jax import lax

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

    layers, stats = weights
    return _jax_loops(loss_fn, layers, stats, x_np, y_np, batch, scan=True)


def jax_keras_loops(make_model, x_np, y_np, batch: int, scan=True) -> tuple[dict, dict]:
    """The Keras model's layers as JAX functions: `model.stateless_call` in the jitted step."""
    import jax.numpy as jnp

    model = make_model()

    def loss_fn(trainable, non_trainable, xb, yb, key):
        # Keras's random layers draw from their seed generators' state, one of the model's
        # non-trainable variables, threaded through the steps like BatchNorm's statistics.
        probs, non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
        probs = probs / jnp.sum(probs, axis=-1, keepdims=True)
        probs = jnp.clip(probs, CE_EPSILON, 1 - CE_EPSILON)
        return -jnp.mean(jnp.sum(yb * jnp.log(probs), axis=-1)), non_trainable

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    loops = _jax_loops(loss_fn, trainable, non_trainable, x_np, y_np, batch, scan)
    scanned = hand_names("jax", _groups(len(y_np) // batch))[0]
    return loops, {} if scan else {scanned: CNN_SCAN}


# ---------------------------------------------------------------------------- TensorFlow


class _TFLoop:
    """Adam written out on the variables, a `tf.function` running `group` steps per call.
    Subclasses give the variables trained and the loss of one batch."""

    trainable: list

    def __init__(self, x, y, batch: int, steps: int, jit_compile: bool):
        import tensorflow as tf

        self.x, self.y, self.batch, self.steps = x, y, batch, steps
        self.group = _groups(steps)
        self.m = [tf.Variable(tf.zeros(v.shape, v.dtype)) for v in self.trainable]
        self.v = [tf.Variable(tf.zeros(v.shape, v.dtype)) for v in self.trainable]
        self.iterations = tf.Variable(0, dtype=tf.int64)
        # Group starts made once, as tensors: a Python int argument would retrace per value.
        self.starts = [tf.constant(s, tf.int32) for s in range(0, steps, self.group)]
        self.run_group = tf.function(self._group, jit_compile=jit_compile)

    def _loss(self, xb, yb):
        raise NotImplementedError

    def _rows(self, data, i):
        """Step `i`'s batch: `tf.slice` with a constant size, so that XLA sees a static
        shape (a `data[start:stop]` slice with tensor bounds does not have one under XLA)."""
        import tensorflow as tf

        def rows(a):
            begin = tf.concat([[i * self.batch], tf.zeros(len(a.shape) - 1, tf.int32)], 0)
            return tf.slice(a, begin, [self.batch, *a.shape[1:]])

        return tf.nest.map_structure(rows, data)

    def _step(self, i):
        import tensorflow as tf

        xb, yb = self._rows(self.x, i), self._rows(self.y, i)
        with tf.GradientTape() as tape:
            loss = self._loss(xb, yb)
        grads = tape.gradient(loss, self.trainable)
        self.iterations.assign_add(1)
        t = tf.cast(self.iterations, tf.float32)
        lr = LEARNING_RATE * tf.sqrt(1 - BETA_2**t) / (1 - BETA_1**t)
        for var, g, m, v in zip(self.trainable, grads, self.m, self.v):
            g = tf.convert_to_tensor(g)  # An Embedding's gradient comes as IndexedSlices.
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


class _TFHandLoop(_TFLoop):
    """The Keras-free loop: `tf.Variable`s."""

    def __init__(self, spec: Spec, x, y, batch: int, steps: int, weights, jit_compile: bool):
        import tensorflow as tf

        layers, stats = weights
        self.spec = spec
        self.layers = [{k: tf.Variable(v) for k, v in layer.items()} for layer in layers]
        self.stats = [(tf.Variable(m), tf.Variable(v)) for m, v in stats]
        self.trainable = [v for layer in self.layers for v in layer.values()]
        super().__init__(x, y, batch, steps, jit_compile)

    def _loss(self, xb, yb):
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
                seed = tf.stack([self.iterations.read_value(), tf.constant(i, tf.int64)])
                h = tf.nn.experimental.stateless_dropout(h, self.spec.dropout, seed)
        logits = h @ self.layers[-1]["kernel"] + self.layers[-1]["bias"]
        return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(yb, logits))


class _TFKerasLoop(_TFLoop):
    """The Keras model's layers as TensorFlow functions: `model(x, training=True)` under the
    tape (its random layers and BatchNorm update their own variables)."""

    def __init__(self, model, x, y, batch: int, steps: int, jit_compile: bool):
        self.model = model
        self.trainable = list(model.trainable_variables)
        super().__init__(x, y, batch, steps, jit_compile)

    def _loss(self, xb, yb):
        import tensorflow as tf

        probs = self.model(xb, training=True)
        probs = probs / tf.reduce_sum(probs, axis=-1, keepdims=True)
        probs = tf.clip_by_value(probs, CE_EPSILON, 1 - CE_EPSILON)
        return tf.reduce_mean(-tf.reduce_sum(yb * tf.math.log(probs), axis=-1))


def _tf_loops(make_loop, x_np, y_np, batch: int, xla: bool) -> tuple[dict, dict]:
    import tensorflow as tf

    x, y = tf.nest.map_structure(tf.constant, x_np), tf.constant(y_np)  # Once, before timing.
    steps = len(y_np) // batch
    with_xla, without = hand_names("tensorflow", _groups(steps))
    loops, left_out = {}, {}
    if xla:
        loops[with_xla] = make_loop(x, y, steps, True).epoch
    else:
        left_out[with_xla] = CNN_XLA
    loops[without] = make_loop(x, y, steps, False).epoch
    return loops, left_out


def tensorflow_hand_loops(spec: Spec, x_np, y_np, batch: int, weights, xla=True):
    return _tf_loops(
        lambda x, y, steps, jit: _TFHandLoop(spec, x, y, batch, steps, weights, jit),
        x_np,
        y_np,
        batch,
        xla,
    )


def tensorflow_keras_loops(make_model, x_np, y_np, batch: int, xla=True):
    return _tf_loops(
        lambda x, y, steps, jit: _TFKerasLoop(make_model(), x, y, batch, steps, jit),
        x_np,
        y_np,
        batch,
        xla,
    )


# --------------------------------------------------------------------------------- torch


def _torch_loops(build, x_np, y_np, batch: int) -> dict:
    """Eager and `torch.compile`d: `build()` gives a new model's `(train_step)`."""
    import torch

    def tensor(a):
        return torch.from_numpy(a)

    x = {k: tensor(v) for k, v in x_np.items()} if isinstance(x_np, dict) else tensor(x_np)
    y = tensor(y_np)  # Once, before timing.
    steps = len(y_np) // batch

    def rows(data, i):
        if isinstance(data, dict):
            return {k: v[i * batch : (i + 1) * batch] for k, v in data.items()}
        return data[i * batch : (i + 1) * batch]

    def epoch_of(train_step):
        def epoch() -> float:
            total = torch.zeros(())
            for i in range(steps):
                total += train_step(rows(x, i), rows(y, i))
            return float(total) / steps

        return epoch

    eager, compiled = hand_names("torch", 1)
    return {eager: epoch_of(build()), compiled: epoch_of(torch.compile(build()))}


def _torch_step(model, parameters, loss_fn):
    import torch

    optimizer = torch.optim.Adam(parameters, lr=LEARNING_RATE, eps=ADAM_EPSILON)

    def train_step(xb, yb):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(xb), yb)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return train_step


def torch_hand_loops(spec: Spec, x_np, y_np, batch: int, weights) -> tuple[dict, dict]:
    """The Keras-free loop: `torch.nn.Sequential`."""
    import torch
    from torch import nn

    layers, stats = weights

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
        # The same starting weights as the other contestants (torch keeps kernels transposed).
        linears = [m for m in model if isinstance(m, nn.Linear)]
        norms = [m for m in model if isinstance(m, nn.BatchNorm1d)]
        assert len(linears) == len(layers) and len(norms) == len(stats)
        with torch.no_grad():
            for module, layer in zip(linears, layers):
                module.weight.copy_(torch.from_numpy(layer["kernel"].T))
                module.bias.copy_(torch.from_numpy(layer["bias"]))
            for module, layer, (mean, var) in zip(norms, layers, stats):
                module.weight.copy_(torch.from_numpy(layer["gamma"]))
                module.bias.copy_(torch.from_numpy(layer["beta"]))
                module.running_mean.copy_(torch.from_numpy(mean))
                module.running_var.copy_(torch.from_numpy(var))
        model.train()
        # Soft (one-hot) targets: cross-entropy on the logits, as Keras's on the softmax.
        return _torch_step(model, model.parameters(), nn.CrossEntropyLoss())

    return _torch_loops(build, x_np, y_np, batch), {}


def torch_keras_loops(make_model, x_np, y_np, batch: int) -> tuple[dict, dict]:
    """The Keras model as the `torch.nn.Module` it is, `torch.optim.Adam` on its parameters."""
    import torch

    def loss_fn(probs, yb):
        probs = probs / probs.sum(dim=-1, keepdim=True)
        probs = probs.clamp(CE_EPSILON, 1 - CE_EPSILON)
        return -(yb * torch.log(probs)).sum(dim=-1).mean()

    def build():
        model = make_model()
        parameters = [p for p in model.parameters() if p.requires_grad]

        def forward(xb):
            return model(xb, training=True)

        return _torch_step(forward, parameters, loss_fn)

    return _torch_loops(build, x_np, y_np, batch), {}


def hand_loops(backend: str, kind: str, make_model, x, y, batch: int, xla: bool):
    """`({name: epoch function}, {name: why left out})` of the backend's hand loops."""
    if kind in PURE:
        spec, weights = _spec(kind), _pure_weights(make_model())
        if backend == "jax":
            return jax_hand_loops(spec, x, y, batch, weights), {}
        if backend == "tensorflow":
            return tensorflow_hand_loops(spec, x, y, batch, weights, xla)
        return torch_hand_loops(spec, x, y, batch, weights)
    if backend == "jax":
        return jax_keras_loops(make_model, x, y, batch, xla)
    if backend == "tensorflow":
        return tensorflow_keras_loops(make_model, x, y, batch, xla)
    return torch_keras_loops(make_model, x, y, batch)


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


DISPATCH = "acc.fit, every batch hook dispatched (Keras's CallbackList)"


def _with_keras_callback_list(fit):
    """`fit` with the callbacks handed to Keras as a list, so that Keras makes its own
    CallbackList (every batch hook dispatched), as before keras_accel's own list."""
    from unittest import mock

    from keras_accel.adapter import callback_list

    def as_given(model, callbacks, data, **kwargs):
        return callbacks

    def dispatched(*args, **kwargs):
        with mock.patch.object(callback_list, "for_call", as_given):
            return fit(*args, **kwargs)

    return dispatched


def _why(error: Exception) -> str:
    lines = str(error).strip().splitlines() or [""]
    return f"{type(error).__name__}: {lines[0][:300]}"


def _contest(runs, left_out, hands, hand_left_out, first_call, args, backend) -> dict:
    """One mode's figures: `--warmup` untimed calls of every contestant, then `--rounds`
    rounds, the contestants in turn. A contestant that raises is left out, said why (a hand
    loop out of every later mode too); one whose steady call (not its first, or a long fit's
    second epoch) took over `--max-call-s` is not called again: that call is its figure.
    `first_call` keeps the hand loops' first calls over the modes (the Keras models are new
    in each)."""
    firsts = {name: first_call[name] for name in runs if name in first_call}
    times = {name: [] for name in runs}
    call_costs = {name: [] for name in runs}
    losses = {}
    slow = []

    def leave_out(name, error):
        del runs[name]
        if backend == "torch" and name.startswith(PLAIN[1]) and isinstance(error, ValueError):
            left_out[name] = TORCH_REFUSED
        else:
            left_out[name] = _why(error)
        if hands.pop(name, None):
            hand_left_out[name] = left_out[name]
        print(f"{args.case}: {name}: left out: {left_out[name]}", file=sys.stderr)

    def measured(name, timed: bool) -> bool:
        """One call of `name`, its figures kept if `timed`; whether to call it again."""
        first = name not in firsts
        started = time.perf_counter()
        try:
            result = runs[name]()
        except Exception as error:  # noqa: BLE001 - any failure leaves the row out, said why.
            leave_out(name, error)
            return False
        wall = time.perf_counter() - started
        firsts.setdefault(name, wall)
        if name in hands:
            first_call.setdefault(name, wall)
        # A Keras fit times itself; a hand loop's call is one epoch.
        loss, seconds, cost = result if isinstance(result, tuple) else (result, wall, None)
        too_slow = (not first or cost is not None) and seconds > args.max_call_s
        if timed or too_slow:
            losses[name] = loss
            times[name].append(seconds)
            if cost is not None:
                call_costs[name].append(cost)
        if too_slow:
            slow.append(name)
            print(f"{args.case}: {name}: {seconds:.0f} s: not called again", file=sys.stderr)
        return not too_slow

    for name in list(runs):  # Warm-up: compilation, `--warmup` calls each.
        for _ in range(args.warmup):
            if not measured(name, timed=False):
                break
    for _ in range(args.rounds):
        for name in [n for n in runs if n not in slow]:  # In turn: noise hits all alike.
            measured(name, timed=True)
    medians = {name: statistics.median(times[name]) for name in runs if times[name]}
    hand_medians = {n: s for n, s in medians.items() if n.startswith("hand")}
    reference = min(hand_medians, key=hand_medians.get) if hand_medians else None
    ref_s = hand_medians.get(reference)
    return {
        "reference": reference,
        "contestants": [
            {
                "name": name,
                "s_per_epoch": s,
                "times": times[name],
                "first_call_s": firsts[name],
                "call_cost_s": statistics.median(call_costs[name]) if call_costs[name] else None,
                "last_loss": float(losses[name]),
                "ratio": ref_s / s if ref_s else None,
                "one_call": name in slow,
            }
            for name, s in medians.items()
        ],
        "left_out": left_out,
    }


def measure(args) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras
    import numpy as np

    from keras_accel import Accelerator

    if args.torch_threads and keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(args.torch_threads)  # Before anything runs: every contestant's.
    acc = Accelerator(seed=0)
    backend = acc.backend
    kind, batch, steps = CASES[args.case]
    rng = np.random.default_rng(0)
    x, y = _data(kind, batch * steps, rng)
    initial = _model(kind).get_weights()  # Every contestant's starting weights.
    xla = kind != "cnn" or args.cnn_xla
    fit_kwargs = {"batch_size": batch, "verbose": 0}
    if not args.shuffle:
        fit_kwargs["shuffle"] = False

    def make_model():
        model = _model(kind)
        model.set_weights(initial)
        return model

    def build(**compile_kwargs):
        with acc.scope():
            model = make_model()
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

    def keras_run(fit, model, mode):
        """One call of a Keras contestant: `(loss, seconds, fixed cost)`."""
        if mode == "repeated":  # The whole `fit(epochs=1)` call, setup included.

            def call():
                started = time.perf_counter()
                history = fit(model, x, y, epochs=1, **fit_kwargs).history
                return history["loss"][-1], time.perf_counter() - started, None

            return call

        # Two epochs in one call: the second is the steady epoch (the first holds the call's
        # setup: its pipeline, its first iterator); what the call took besides two steady
        # epochs is its fixed cost.
        def epoch():
            timer = EpochTimes()
            timer.times = []
            started = time.perf_counter()
            history = fit(model, x, y, epochs=2, callbacks=[timer], **fit_kwargs).history
            call = time.perf_counter() - started
            return history["loss"][-1], timer.times[1], call - 2 * timer.times[1]

        return epoch

    def plain_fit(model, *args, **kwargs):
        return model.fit(*args, **kwargs)

    hand_left_out = {}
    try:
        hands, hand_left_out = hand_loops(backend, kind, make_model, x, y, batch, xla)
    except Exception as error:  # noqa: BLE001 - any failure leaves the rows out, said why.
        hands = {}
        hand_left_out = {"hand loops": _why(error)}
        print(f"hand loops: left out: {hand_left_out['hand loops']}", file=sys.stderr)
    first_call = {}  # Each contestant's first call ever (compilation included).
    modes = {}
    for mode in args.mode.split(","):
        # Keras contestants: new models per mode, every one from the same weights.
        keras_runs = {ACC: (acc.fit, {})}
        jit = {"jit_compile": True}
        if backend == "tensorflow":
            # The Accelerator measures its group as one XLA program against one XLA launch
            # per step (as Keras runs a jit_compile=True model): the CNN runs it too.
            keras_runs[ACC + JIT] = (acc.fit, jit)
        if args.dispatch and mode == "long":
            compiled = jit if backend == "tensorflow" else {}
            keras_runs[DISPATCH] = (_with_keras_callback_list(acc.fit), compiled)
        keras_runs[PLAIN[0]] = (plain_fit, {})
        keras_runs[PLAIN[1]] = (plain_fit, {"steps_per_execution": 32})
        if backend == "tensorflow":
            # Keras's own groups launch one XLA program per step from a graph while loop:
            # no XLA while loop, so the CNN runs it too.
            keras_runs[PLAIN[1] + JIT] = (plain_fit, {"steps_per_execution": 32, **jit})
        runs = dict(hands)
        left_out = dict(hand_left_out)
        for name, (fit, compile_kwargs) in keras_runs.items():
            runs[name] = keras_run(fit, build(**compile_kwargs), mode)

        modes[mode] = _contest(runs, left_out, hands, hand_left_out, first_call, args, backend)
    return {
        "backend": backend,
        "case": args.case,
        "steps": steps,
        "batch_size": batch,
        "shuffle": args.shuffle,
        "threads": _threads(backend),
        "hand_loops_use_keras_layers": kind not in PURE,
        "modes": modes,
    }


# -------------------------------------------------------------------------------- parent


def _keras_best(contestants: list[dict], acc_name: str) -> float | None:
    """The faster of plain `model.fit` and `model.fit(steps_per_execution=32)` with the same
    `jit_compile` as the `acc.fit` row `acc_name`."""
    suffix = JIT if acc_name.endswith(JIT) else ""
    names = {p + suffix for p in PLAIN}
    times = [c["s_per_epoch"] for c in contestants if c["name"] in names]
    return min(times) if times else None


def _cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _table(case: str, mode: str, rows: list[dict]) -> None:
    kind, batch, steps = CASES[case]
    what = {
        "long": "one long call: the steady epoch of fit(epochs=2)",
        "repeated": "repeated fit(epochs=1) calls on one model, each call timed whole",
    }[mode]
    print(f"\n### {case}, {mode}: batch {batch}, {steps} steps per epoch; {what}\n")
    last = "fit call's fixed cost s" if mode == "long" else "first call s"
    print(
        "| backend | contestant | s/epoch (median) | best hand loop / contestant "
        f"| fastest plain model.fit / acc.fit | {last} |"
    )
    print("|---|---|---:|---:|---:|---:|")
    notes = []
    for row in rows:
        if "error" in row:
            print(f"| {row['backend']} | error: {row['error']} | | | | |")
            continue
        result = row["modes"].get(mode)
        if result is None:
            continue
        contestants = result["contestants"]
        for c in contestants:
            name = c["name"] + (" (reference)" if c["name"] == result["reference"] else "")
            versus = ""
            if c["name"].startswith(ACC) and c["name"] != DISPATCH:
                best = _keras_best(contestants, c["name"])
                versus = _cell(best / c["s_per_epoch"]) if best else "n/a"
            if mode == "long":
                extra = "" if c["call_cost_s"] is None else f"{c['call_cost_s']:.3f}"
            else:
                extra = f"{c['first_call_s']:.3f}"
            print(
                f"| {row['backend']} | {name} | {c['s_per_epoch']:.3f} | {_cell(c['ratio'])} "
                f"| {versus} | {extra} |"
            )
            if c.get("one_call"):
                notes.append(
                    f"{row['backend']}: {c['name']}: a steady call took over --max-call-s "
                    f"({c['times'][-1]:.0f} s): not called again, that call is its last figure"
                )
            if len(c["times"]) > 1 and c["times"][0] > 2 * c["s_per_epoch"]:
                # Still compiling after the warm-up: the median hides it only with rounds.
                notes.append(
                    f"{row['backend']}: {c['name']}'s first timed call took "
                    f"{c['times'][0]:.2f} s, over twice its median: not warm yet (raise --warmup)"
                )
        for name, why in result["left_out"].items():
            if why in (TORCH_REFUSED, CNN_XLA, CNN_SCAN):
                print(f"| {row['backend']} | {name} | {why} | | | |")
            else:
                notes.append(f"{row['backend']}: {name} left out: {why}")
        layers = (
            "the hand loops call the Keras model's layers"
            if row.get("hand_loops_use_keras_layers")
            else "the hand loops hold no Keras"
        )
        notes.append(f"{row['backend']}: {layers}; {row['threads']}")
    print()
    for note in notes:
        print(f"- {note}")


def _summary(results: dict, backends: list[str], modes: list[str]) -> None:
    """Models by backends: acc.fit against the best hand loop, and against plain Keras."""

    def acc_ratio(row, mode, against_keras):
        result = row.get("modes", {}).get(mode)
        acc = [c for c in (result or {}).get("contestants", []) if c["name"] == ACC]
        if not acc:
            return None
        if not against_keras:
            return acc[0]["ratio"]
        best = _keras_best(result["contestants"], ACC)
        return best / acc[0]["s_per_epoch"] if best else None

    titles = (
        "acc.fit against the best hand-written loop (best hand loop's time / acc.fit's)",
        "acc.fit against the faster of plain model.fit and model.fit(steps_per_execution=32) "
        "(its time / acc.fit's)",
    )
    for against_keras, title in enumerate(titles):
        print(f"\n### Summary: {title}; {' / '.join(modes)}\n")
        print("| model | " + " | ".join(backends) + " |")
        print("|---|" + "---:|" * len(backends))
        for case, rows in results.items():
            by_backend = {row["backend"]: row for row in rows}
            cells = []
            for backend in backends:
                row = by_backend.get(backend, {})
                cells.append(
                    "error"
                    if "error" in row
                    else " / ".join(_cell(acc_ratio(row, m, against_keras)) for m in modes)
                )
            print(f"| {case} | " + " | ".join(cells) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="jax,tensorflow,torch")
    parser.add_argument(
        "--case",
        default="basket",
        help=f"comma-separated: basket ({', '.join(BASKET)}) or any of {', '.join(CASES)}",
    )
    parser.add_argument(
        "--mode",
        default="long,repeated",
        help="comma-separated: long (the steady epoch of one fit(epochs=2) call), repeated "
        "(whole fit(epochs=1) calls, one after another on one model)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed calls of each contestant first, in each mode (compilation; torch.compile "
        "and acc.fit's measured choices can take more than one)",
    )
    parser.add_argument(
        "--no-shuffle",
        dest="shuffle",
        action="store_false",
        help="fit the Keras models with shuffle=False, as the hand loops read the rows",
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="add acc.fit with Keras's own CallbackList (every batch hook dispatched), long mode",
    )
    parser.add_argument(
        "--cnn-xla",
        action="store_true",
        help="run JAX's scan and TensorFlow's XLA hand loops on the CNN cases too (XLA:CPU's "
        "convolution gradients in a while loop: minutes an epoch)",
    )
    parser.add_argument(
        "--max-call-s",
        type=float,
        default=60.0,
        help="a contestant whose warm-up call took longer is not timed again: that call "
        "(its steady epoch in the long mode) is its figure, said so under the table",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch's intra-op threads for every contestant (0: torch's default, one per core); "
        "1 keeps torch's figures steady on a host whose cores other work shares",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    modes = args.mode.split(",")
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--mode: comma-separated from {list(MODES)}; received {args.mode!r}")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    cases = [c for name in args.case.split(",") for c in (BASKET if name == "basket" else [name])]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; valid: basket, {', '.join(CASES)}")
    backends = args.backends.split(",")
    common = [
        f"--rounds={args.rounds}",
        f"--warmup={args.warmup}",
        f"--mode={args.mode}",
        f"--max-call-s={args.max_call_s}",
        f"--torch-threads={args.torch_threads}",
        *([] if args.shuffle else ["--no-shuffle"]),
        *(["--dispatch"] if args.dispatch else []),
        *(["--cnn-xla"] if args.cnn_xla else []),
    ]
    results = {}
    started = time.perf_counter()
    for case in dict.fromkeys(cases):
        results[case] = []
        for backend in backends:
            row = run_child(
                os.path.join(HERE, "hand_loop.py"), backend, [*common, f"--case={case}"]
            )
            results[case].append({"case": case, **row} if "error" in row else row)
            took = time.perf_counter() - started
            print(f"{case} on {backend}: done, {took:.0f} s in", file=sys.stderr, flush=True)
    for case, rows in results.items():
        for mode in modes:
            _table(case, mode, rows)
    _summary(results, backends, modes)
    print(f"\nTotal: {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row for rows in results.values() for row in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
