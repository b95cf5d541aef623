"""Losses and gradients across replicas, owned by the call: no Keras, TensorFlow or JAX class
or module changes while a call runs; the optimizer clips the global batch's gradient; a
custom train_step trains as one device on TensorFlow; a class's own
`compute_loss` (keras-io's knowledge distillation), a layer's `add_loss` of a Keras loss
(keras-io's endpoint layer) and an Embedding's sparse gradient (keras-io's transformer's
position embedding) give one device's loss and training (docs/accelerator.md, "Custom
steps")."""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accel import Accelerator
from tests.helpers import (
    FEW_REPLICAS,
    assert_weights_close,
    changed_library_state,
    compiled_mlp,
    data,
    library_state,
)
from tests.keras_io import vision as keras_io_vision


class _Snapshot(keras.callbacks.Callback):
    """Reads `library_state()` at the end of every epoch, evaluation and prediction: inside
    the Accelerator's call, after its steps ran."""

    def __init__(self):
        super().__init__()
        self.states = []

    def on_epoch_end(self, epoch, logs=None):
        self.states.append(library_state())

    def on_test_end(self, logs=None):
        self.states.append(library_state())

    def on_predict_end(self, logs=None):
        self.states.append(library_state())


class HoldsItsLoss(keras.Sequential):
    """A custom step as Keras's guides write them: a loss object it holds, and compute_loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.tracker = keras.metrics.Mean(name="own")

    def train_step(self, data):
        x, y = data[:2]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred) + self.loss_fn(y, y_pred)
        self.optimizer.apply(
            tape.gradient(loss, self.trainable_variables), self.trainable_variables
        )
        self.tracker.update_state(loss)
        return {"own": self.tracker.result()}


def test_no_library_class_or_module_changes_during_any_call(backend):
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(70)  # Batches of 16: the last one is padded.
    with acc.scope():
        model = compiled_mlp()
        # The TF guide's custom step (JAX's steps are stateless functions of their own).
        custom = (HoldsItsLoss if backend == "tensorflow" else keras.Sequential)(
            compiled_mlp().layers
        )
        custom.compile("sgd", "sparse_categorical_crossentropy")
    acc.fit(model, x, y, batch_size=16, verbose=0)  # Keras imports and caches what it uses.
    acc.fit(custom, x[:64], y[:64], batch_size=16, verbose=0)
    before = library_state()
    snapshot = _Snapshot()
    acc.fit(
        model, x, y, batch_size=16, epochs=1, verbose=0, validation_split=0.2, callbacks=[snapshot]
    )
    acc.evaluate(model, x, y, batch_size=16, verbose=0, callbacks=[snapshot])
    acc.predict(model, x, batch_size=16, verbose=0, callbacks=[snapshot])
    acc.fit(custom, x[:64], y[:64], batch_size=16, verbose=0, callbacks=[snapshot])
    loop = acc.loop(model)
    for batch in loop.batches(x, y, batch_size=16):
        loop.train_step(batch)
    snapshot.states.append(library_state())
    assert len(snapshot.states) == 6
    for state in snapshot.states:
        assert changed_library_state(before, state) == []


def _clipped_pair(acc, **clipping):
    def make():
        return compiled_mlp(optimizer=keras.optimizers.SGD(0.5, **clipping), batchnorm=False)

    with acc.scope():
        model = make()
    twin = make()
    twin.set_weights(model.get_weights())
    return model, twin


@pytest.mark.parametrize(
    "clipping",
    [{"clipnorm": 0.05}, {"global_clipnorm": 0.05}, {"clipvalue": 0.002}],
    ids=["clipnorm", "global_clipnorm", "clipvalue"],
)
def test_the_optimizer_clips_the_global_batch_s_gradient(clipping):
    # Keras on TF clips each replica's share before summing the shares; here the sum is
    # clipped, as one device clips its gradient.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    model, twin = _clipped_pair(acc, **clipping)
    x, y = data(70)
    acc.fit(model, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    twin.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())


class AveragesItself(keras.Sequential):
    """A custom step that averages a loss function's values itself (not a Keras loss object),
    as keras-io's VAE does."""

    def train_step(self, data):
        x, y = data[:2]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = ops.mean(keras.losses.sparse_categorical_crossentropy(y, y_pred))
        self.optimizer.apply(
            tape.gradient(loss, self.trainable_variables), self.trainable_variables
        )
        return {"loss": loss}


class DividesItself(keras.Sequential):
    """A custom step written for TensorFlow's convention, as its guides teach: the loss
    divided by the replica count (`tf.nn.compute_average_loss`), the gradients summed."""

    def train_step(self, data):
        x, y = data[:2]
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            per_row = keras.losses.sparse_categorical_crossentropy(y, y_pred)
            loss = tf.nn.compute_average_loss(per_row)
        self.optimizer.apply(
            tape.gradient(loss, self.trainable_variables), self.trainable_variables
        )
        return {"loss": loss}


class CallsKerasStep(keras.Sequential):
    """A custom step that hands the batch to Keras's own (`super().train_step`)."""

    def train_step(self, data):
        return super().train_step(data)


@pytest.mark.parametrize(
    "step", [AveragesItself, DividesItself, CallsKerasStep, HoldsItsLoss], ids=lambda c: c.__name__
)
def test_a_custom_train_step_trains_as_one_device(backend, step):
    """On TF a custom `train_step` runs as one device over each replica's rows, with the
    replicas' gradients averaged (its own `ops.mean` of a loss function, keras-io's VAE,
    trained N times too fast under raw MirroredStrategy); a step that divides by the
    replica count itself, as TensorFlow's guides teach, keeps their convention; one that
    calls Keras's step and one that holds a Keras loss object train as one device too."""
    if backend != "tensorflow":
        pytest.skip("TF's replicas run a custom step each; on JAX one program runs it")
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x, y = data(64)  # 4 batches of 16: nothing padded.

    def make():
        model = step(compiled_mlp(batchnorm=False).layers)
        model.compile(keras.optimizers.SGD(0.2), "sparse_categorical_crossentropy")
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    one_device.set_weights(ours.get_weights())
    acc.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), one_device.get_weights())


class UpdatesAMetricInComputeLoss(keras.Model):
    """Keras's trainer test `test_metric_update_in_compute_loss`: a class's own compute_loss
    that calls Keras's and updates a metric with the loss."""

    def __init__(self):
        super().__init__()
        self.custom_metric = keras.metrics.Mean(name="custom")
        self.dense = keras.layers.Dense(2, kernel_initializer="ones", activity_regularizer="l2")

    def call(self, x):
        return self.dense(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.custom_metric.update_state(loss * 4)
        return loss


def test_a_metric_updated_in_compute_loss_and_jit_compile_give_one_device_s_numbers():
    # On TF Keras's compute_loss returns each replica's share of the loss (divided by the
    # replica count): the metric reported 1/N of one device's. jit_compile=True (XLA) fails
    # under a MirroredStrategy over CPU devices; the call runs without it, with a note.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    x = np.ones((32, 4), "float32") * np.linspace(0.5, 1.5, 32)[:, None].astype("float32")
    y = np.ones((32, 2), "float32") * 2

    def make():
        model = UpdatesAMetricInComputeLoss()
        model.compile(optimizer="sgd", loss="mse", jit_compile=True)
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    history = acc.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert ours.jit_compile  # The model keeps what it was compiled with.
    assert_weights_close(ours.get_weights(), one_device.get_weights())
    for name in ("loss", "custom"):
        np.testing.assert_allclose(history.history[name], expected.history[name], rtol=1e-5)
    logs = acc.evaluate(ours, x, y, batch_size=16, verbose=0, return_dict=True)
    assert logs == pytest.approx(
        one_device.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
    )


def _devices(backend):
    # torch runs one process here (its processes: tests/adapter/test_torch_losses.py).
    return None if backend == "torch" else FEW_REPLICAS


def _dense(seed, units):
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(
                8, "relu", kernel_initializer=keras.initializers.GlorotUniform(seed)
            ),
            keras.layers.Dense(
                units, kernel_initializer=keras.initializers.GlorotUniform(seed + 1)
            ),
        ]
    )


class Distiller(keras_io_vision.Distiller):
    """keras-io's vision/knowledge_distillation.py: a class's own compute_loss of two Keras
    loss objects it holds (divided by the replica count on TF), plus, here, a mean of its
    own (not divided) as Keras's compute_loss docs write one."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, allow_empty=False):
        own = ops.mean(ops.square(y_pred)) * 0.01
        return super().compute_loss(x, y, y_pred, allow_empty=allow_empty) + own


@pytest.mark.torch
def test_a_class_s_own_compute_loss_reports_and_trains_as_one_device(backend):
    # TF divided the held loss objects by the replica count and not the mean of its own, and
    # Keras's step multiplied the sum back: the loss reported 8.1 times one device's over 8
    # replicas, and the own mean's gradient counted once per replica. 64 rows in batches of
    # 16: nothing padded (the loss reads no sample_weight).
    acc = Accelerator(seed=0, devices=_devices(backend))

    def make():
        model = Distiller(_dense(0, 3), _dense(5, 3))
        model.compile(
            keras.optimizers.SGD(0.5),
            [keras.metrics.SparseCategoricalAccuracy()],
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.losses.KLDivergence(),
            alpha=0.1,
            temperature=10,
        )
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    x, y = data(64)
    ours(x[:2]), one_device(x[:2])
    one_device.set_weights(ours.get_weights())
    history = acc.fit(ours, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = one_device.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), one_device.get_weights())
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    logs = acc.evaluate(ours, x, y, batch_size=16, verbose=0, return_dict=True)
    assert logs == pytest.approx(
        one_device.evaluate(x, y, batch_size=16, verbose=0, return_dict=True), rel=1e-5
    )


class LogisticEndpoint(keras.layers.Layer):
    """keras-io's keras_recipes/endpoint_layer_pattern.py: a layer that adds a Keras loss
    object's value with `add_loss` and updates a metric."""

    def __init__(self, name=None):
        super().__init__(name=name)
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)
        self.accuracy_fn = keras.metrics.BinaryAccuracy()

    def call(self, logits, targets=None, sample_weight=None):
        if targets is not None:
            loss = self.loss_fn(targets, logits, sample_weight)
            self.add_loss(loss)
            self.accuracy_fn.update_state(targets, logits, sample_weight)
        return ops.sigmoid(logits)


def test_a_layer_s_added_keras_loss_reports_and_trains_as_one_device(backend):
    # TF divided it twice (the loss object, then Keras's sum of the added losses): the loss
    # reported 1/8 of one device's over 8 replicas, and trained with 1/8 of its gradient.
    if backend == "jax":
        # Plain Keras 3.15 cannot run it there: the metric the layer updates in its call
        # fails inside the traced step ("'NoneType' object is not callable").
        pytest.skip("plain Keras on JAX fails on the metric updated in the layer's call")
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)

    def make():
        inputs = keras.Input((6,), name="inputs")
        targets = keras.Input((1,), name="targets")
        logits = keras.layers.Dense(1, kernel_initializer=keras.initializers.GlorotUniform(3))(
            inputs
        )
        outputs = LogisticEndpoint(name="predictions")(logits, targets)
        model = keras.Model(inputs=[inputs, targets], outputs=outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.5))
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    one_device.set_weights(ours.get_weights())
    x, y = data(64)
    inputs = {"inputs": x, "targets": (y > 0).astype("float32")[:, None]}
    history = acc.fit(ours, inputs, batch_size=16, epochs=2, shuffle=False, verbose=0)
    expected = one_device.fit(inputs, batch_size=16, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), one_device.get_weights())
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)


class TokenAndPosition(keras.layers.Layer):
    """keras-io's nlp/text_classification_with_transformer.py's TokenAndPositionEmbedding."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


@pytest.mark.torch
@pytest.mark.parametrize("optimizer", ["adam", "rmsprop"])
def test_an_embedding_s_sparse_gradient_reaches_the_optimizer_as_one_device_s(backend, optimizer):
    # On TF the replicas' IndexedSlices were concatenated: the position embedding's entries
    # came once per replica, and Adam (RMSprop), which squares them entry by entry, moved
    # it otherwise than one device (which has each position once, summed over the batch).
    acc = Accelerator(seed=0, devices=_devices(backend))

    def make():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((5,), dtype="int32")
        hidden = TokenAndPosition(5, 11, 4)(tokens)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
        model = keras.Model(tokens, keras.layers.Dense(3)(hidden))
        model.compile(
            keras.optimizers.get({"class_name": optimizer, "config": {"learning_rate": 0.01}}),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model

    with acc.scope():
        ours = make()
    one_device = make()
    one_device.set_weights(ours.get_weights())
    rng = np.random.default_rng(0)
    x = rng.integers(0, 11, (32, 5)).astype("int32")
    y = rng.integers(0, 3, 32)
    history = acc.fit(ours, x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    expected = one_device.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    assert_weights_close(ours.get_weights(), one_device.get_weights(), atol=1e-6)
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-6)


def test_sparse_gradients_summed_entry_by_entry_are_those_of_indices_fixed_by_the_graph(
    backend,
):
    """Indices from constants and static shapes are the same in every replica; indices from
    the batch, or from a model's output (deeper than Python's recursion limit), are not."""
    if backend != "tensorflow":
        pytest.skip("IndexedSlices are TensorFlow's")
    import tensorflow as tf

    from keras_accel.adapter.backends.tensorflow.gradients import _same_in_every_replica

    table = tf.Variable(tf.ones((6, 2)))
    found = {}

    @tf.function
    def gradients(ids, x):
        deep = x
        for _ in range(1500):
            deep = tf.sin(deep)
        with tf.GradientTape(persistent=True) as tape:
            parts = [
                tf.reduce_sum(tf.gather(table, tf.range(0, tf.shape(ids)[-1]))),
                tf.reduce_sum(tf.gather(table, ids)),
                tf.reduce_sum(tf.gather(table, tf.argmax(deep, axis=-1))),
            ]
        sliced = [tape.gradient(part, table) for part in parts]
        found["shared"] = [_same_in_every_replica(g) for g in sliced]
        return parts[0]

    gradients(tf.constant([[1, 2, 3]]), tf.ones((2, 6)))
    assert found["shared"] == [True, False, False]
