"""Two threads of one process: an Accelerator fit beside another one, or beside a plain
`model.fit`, each ending where it ends alone, and Keras left as it was."""

import contextlib
import threading

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import (
    FEW_REPLICAS,
    assert_weights_close,
    changed_library_state,
    compiled_mlp,
    data,
    library_state,
    weights_of,
)

TIMEOUT_S = 300  # A wait that fails the test instead of hanging it, on a loaded machine.


class _Hook(keras.callbacks.Callback):
    """Runs `action()` at the end of epoch `epoch` (no batch hook: fusion stays as alone)."""

    def __init__(self, epoch, action):
        super().__init__()
        self.epoch, self.action = epoch, action

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            self.action()


def _run(threads):
    """Start `threads` (functions), join them, raise the first error any raised."""
    errors = []

    def guarded(function):
        def run():
            try:
                function()
            except BaseException as error:
                errors.append(error)

        return run

    started = [threading.Thread(target=guarded(f), daemon=True) for f in threads]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(TIMEOUT_S)
        assert not thread.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


def _fresh_pair(seed):
    """A model in a new Accelerator's scope and its twin with the same initial weights."""
    acc = Accelerator(seed=seed, devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp(seed=seed)
    return acc, model


def test_two_accelerator_fits_in_two_threads_end_as_alone_and_leave_keras_as_it_was(backend):
    inputs = [data(96, seed=1), data(80, seed=2)]

    def fit(acc, model, x, y, callbacks=()):
        acc.fit(
            model,
            x,
            y,
            batch_size=16,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=list(callbacks),
        )

    alone = []
    for seed, (x, y) in zip((1, 2), inputs):
        acc, model = _fresh_pair(seed)
        fit(acc, model, x, y)
        alone.append(weights_of(model))
    before = library_state()  # After the runs alone: what Keras made the first time is made.

    (acc_a, model_a), (acc_b, model_b) = _fresh_pair(1), _fresh_pair(2)
    both_in_fit = threading.Barrier(2, timeout=TIMEOUT_S)
    a_done = threading.Event()

    def first():
        # Both calls run at once; then this one ends while the other is still inside its.
        fit(acc_a, model_a, *inputs[0], callbacks=[_Hook(0, both_in_fit.wait)])
        a_done.set()

    def second():
        hooks = [_Hook(0, both_in_fit.wait), _Hook(0, lambda: a_done.wait(TIMEOUT_S))]
        fit(acc_b, model_b, *inputs[1], callbacks=hooks)

    _run([first, second])
    assert_weights_close(weights_of(model_a), alone[0])
    assert_weights_close(weights_of(model_b), alone[1])
    assert changed_library_state(before, library_state()) == []


class ReportsComputeLoss(keras.Sequential):
    """Keras's guide's custom step on TensorFlow: it reports what `compute_loss` returns,
    which plain Keras divides by the replica count under a tf.distribute strategy."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data[:2]
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"reported": loss}


def _plain_model(backend, seed):
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    model = ReportsComputeLoss(layers) if backend == "tensorflow" else keras.Sequential(layers)
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def test_a_plain_fit_beside_an_accelerator_fit_keeps_keras_s_own_numbers(backend, num_devices):
    """The plain fit runs while an Accelerator fit is inside its call, in another thread.
    On TF it runs under a second Accelerator's strategy (other devices than the call's),
    outside any call of it: Keras's own loss scaling and gradient sum apply there, and its
    custom step shows the loss divided by the replica count, as alone."""
    if backend == "tensorflow" and num_devices < 4:
        pytest.skip("two strategies over different devices")
    x, y = data(64, seed=3)
    other = Accelerator(seed=0, devices=["cpu:2", "cpu:3"])

    def plain(model):
        with other.scope() if backend == "tensorflow" else contextlib.nullcontext():
            history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return history.history["reported" if backend == "tensorflow" else "loss"], weights_of(model)

    with other.scope() if backend == "tensorflow" else contextlib.nullcontext():
        alone_model, beside_model = _plain_model(backend, 4), _plain_model(backend, 4)
    alone = plain(alone_model)

    acc, model = _fresh_pair(5)
    entered, plain_done = threading.Event(), threading.Event()
    got = {}

    def accelerated():
        def hold():
            entered.set()
            plain_done.wait(TIMEOUT_S)

        acc.fit(
            model, *data(48, seed=5), batch_size=16, epochs=2, verbose=0, callbacks=[_Hook(0, hold)]
        )

    def beside():
        assert entered.wait(TIMEOUT_S)
        try:
            got["plain"] = plain(beside_model)
        finally:
            plain_done.set()

    _run([accelerated, beside])
    np.testing.assert_allclose(got["plain"][0], alone[0], rtol=1e-6)
    assert_weights_close(got["plain"][1], alone[1])
