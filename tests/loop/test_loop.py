"""Accelerator.loop: one custom training loop for both backends, equal to Keras's fit."""

import os

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler
from tests.helpers import (
    FEW_REPLICAS,
    assert_replicas_agree,
    assert_weights_close,
    compiled_mlp,
    data,
)

ROWS, BATCH, EPOCHS = 101, 16, 2  # 7 batches an epoch, the last with 5 real rows.


def _optimizer(**kwargs):
    # SGD, not Adam: Adam rescales the near-zero gradient of a bias before BatchNormalization
    # into full steps, so summation-order noise there would swamp the comparison.
    return keras.optimizers.SGD(0.1, momentum=0.9, **kwargs)


def _models(acc, **optimizer_args):
    """A model compiled in the scope, and a single-device twin with the same weights."""
    keras.backend.clear_session(free_memory=False)
    with acc.scope():
        model = compiled_mlp()
        model.compile(_optimizer(**optimizer_args), "sparse_categorical_crossentropy")
    twin = compiled_mlp()
    twin.compile(
        _optimizer(**optimizer_args),
        "sparse_categorical_crossentropy",
        metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
    )
    twin.set_weights(model.get_weights())
    return model, twin


def _train(loop, x, y, epochs=EPOCHS, **batches):
    results = []
    for epoch in range(epochs):
        loop.reset_metrics()
        for batch in loop.batches(x, y, batch_size=BATCH, epoch=epoch, **batches):
            loop.train_step(batch)
        results.append(loop.results())
    return results


def _close(got, want):
    assert set(got) == set(want), (got, want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("devices", [1, 2, None], ids=["1", "2", "all"])
def test_loop_equals_plain_single_device_fit(devices):
    acc = Accelerator(devices=devices, seed=0)
    model, twin = _models(acc)
    x, y = data(ROWS)
    loop = acc.loop(
        model,
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")],
    )
    results = _train(loop, x, y)
    history = twin.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    # Same weights at every replica count (BatchNormalization over real rows included):
    # only the summation order differs, hence the float32 tolerance.
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=1e-5)
    for epoch, row in enumerate(results):
        _close(row, {k: v[epoch] for k, v in history.history.items()})
    _close(loop.evaluate(x, y, batch_size=BATCH), twin.evaluate(x, y, verbose=0, return_dict=True))
    predictions = loop.predict(x, batch_size=BATCH)
    assert predictions.shape == (ROWS, 3)
    np.testing.assert_allclose(predictions, twin.predict(x, verbose=0), atol=1e-5)
    # One compilation per step kind, for every epoch and the padded last batch alike.
    assert loop.traces == {"train": 1, "test": 1, "predict": 1}


def test_loop_equals_accelerator_fit():
    acc = Accelerator(seed=0)
    model, _ = _models(acc)
    x, y = data(ROWS)
    other = keras.models.clone_model(model)
    with acc.scope():
        other = compiled_mlp()
        other.compile(_optimizer(), "sparse_categorical_crossentropy")
    other.set_weights(model.get_weights())
    _train(acc.loop(model), x, y, shuffle=True)
    acc.fit(other, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=True, verbose=0)
    assert_weights_close(model.get_weights(), other.get_weights(), atol=1e-5)


def test_loop_keeps_the_accelerators_batchnorm_choice():
    # sync_batchnorm=False: the loop's BatchNormalization statistics are each replica's own
    # (TF), as in acc.fit with the same Accelerator; with True they would be the global ones.
    acc = Accelerator(devices=FEW_REPLICAS, seed=0, sync_batchnorm=False)
    model, _ = _models(acc)
    with acc.scope():
        other = compiled_mlp()
        other.compile(_optimizer(), "sparse_categorical_crossentropy")
    other.set_weights(model.get_weights())
    x, y = data(96)  # Whole batches: no padding.
    _train(acc.loop(model), x, y)
    acc.fit(other, x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), other.get_weights(), atol=1e-5)


@pytest.mark.parametrize(
    "optimizer_args",
    [{"global_clipnorm": 0.05}, {"clipnorm": 0.01}, {"gradient_accumulation_steps": 2}],
    ids=["global_clipnorm", "clipnorm", "accumulation"],
)
def test_clipping_and_accumulation_act_on_the_global_gradient(optimizer_args, backend):
    acc = Accelerator(seed=0)
    model, twin = _models(acc, **optimizer_args)
    accumulating = "gradient_accumulation_steps" in optimizer_args
    if accumulating and backend == "tensorflow" and acc.num_replicas > 1:
        with pytest.raises(NotImplementedError, match="accumulation does not run under"):
            acc.loop(model)
        return
    x, y = data(96)  # 6 full batches: accumulation pairs them.
    _train(acc.loop(model), x, y)
    twin.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=1e-5)


def test_sample_weights_and_weighted_metrics():
    acc = Accelerator(seed=0)
    model, twin = _models(acc)
    twin.compile(
        _optimizer(),
        "sparse_categorical_crossentropy",
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("w_acc")],
    )
    x, y = data(ROWS)
    sw = np.linspace(0.2, 2.0, ROWS).astype("float32")
    loop = acc.loop(model, weighted_metrics=[keras.metrics.SparseCategoricalAccuracy("w_acc")])
    results = _train(loop, x, y, sample_weight=sw)
    history = twin.fit(
        x, y, sample_weight=sw, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    assert_weights_close(model.get_weights(), twin.get_weights(), atol=1e-5)
    _close(results[-1], {k: v[-1] for k, v in history.history.items()})


def test_float16_training_scales_the_loss():
    acc = Accelerator(seed=0, mixed_precision="float16")
    with acc.scope():
        model = compiled_mlp(batchnorm=False)
        # Keras's initial scale, 2**15, overflows this model's float16 gradients at first
        # on JAX, whose step differentiates the global batch's loss; TF's replicas each
        # differentiate their share of it (1/N), so the same overflow needs N times more.
        initial = 2.0**15 * (acc.num_replicas if keras.backend.backend() == "tensorflow" else 1)
        optimizer = keras.optimizers.LossScaleOptimizer(_optimizer(), initial_scale=initial)
    loop = acc.loop(model, optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy())
    assert isinstance(loop.optimizer, keras.optimizers.LossScaleOptimizer)
    results = _train(loop, *data(64))
    assert all(np.isfinite(row["loss"]) for row in results)
    # Dynamic loss scaling skips the steps whose scaled gradients overflow (the first ones,
    # from the initial scale) and halves the scale each time.
    assert 0 < int(np.asarray(loop.optimizer.iterations)) < EPOCHS * 4
    assert float(np.asarray(loop.optimizer.dynamic_scale)) < initial
    # Every replica skipped (or applied) the same steps: the same scale, counters, weights.
    assert_replicas_agree(loop.optimizer.variables, acc.num_replicas, exact=True)
    assert_replicas_agree(model.weights, acc.num_replicas)


def test_callbacks_from_the_loop_resume_exactly(tmp_path):
    """LearningRateScheduler, History and BackupAndRestore driven by a loop, as in fit: an
    interrupted loop resumed from its backup ends where an uninterrupted one ends."""
    x, y = data(96)  # 6 batches an epoch
    epochs = 3

    def run(stop_at_epoch=None):
        acc = Accelerator(seed=0)
        model, _ = _models(acc)
        loop = acc.loop(model)
        history = History()
        callbacks = loop.callbacks(
            [
                LearningRateScheduler(lambda step: 0.1 / (1 + step), update_freq="step"),
                history,
                BackupAndRestore(str(tmp_path / "backup")),
            ],
            epochs=epochs,
            steps=6,
        )
        callbacks.on_train_begin()
        for epoch in range(loop.initial_epoch, epochs):
            if epoch == stop_at_epoch:
                return None
            callbacks.on_epoch_begin(epoch)
            loop.reset_metrics()
            for step, batch in enumerate(loop.batches(x, y, batch_size=BATCH, epoch=epoch)):
                callbacks.on_train_batch_begin(step)
                loop.train_step(batch)
                callbacks.on_train_batch_end(step)
            callbacks.on_epoch_end(epoch, loop.results())
        callbacks.on_train_end()
        return model.get_weights(), history

    uninterrupted, full = run()
    assert run(stop_at_epoch=2) is None  # Killed before epoch 3: epochs 1-2 backed up.
    resumed, history = run()
    assert_weights_close(resumed, uninterrupted, atol=1e-6)
    assert history.epoch == [0, 1, 2]
    np.testing.assert_allclose(history.history["learning_rate"], full.history["learning_rate"])


def test_bad_inputs_are_clear_errors():
    acc = Accelerator(seed=0)
    model, _ = _models(acc)
    x, y = data(32)

    def scalar(y_true, y_pred):
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred))

    loop = acc.loop(model, loss=scalar)
    with pytest.raises(ValueError, match=r"one loss per example .* Received: a scalar from scalar"):
        loop.train_step(next(iter(loop.batches(x, y, batch_size=BATCH))))

    def per_class(y_true, y_pred):
        return keras.ops.transpose(y_pred)  # (classes, batch): not one loss per row

    loop = acc.loop(model, loss=per_class)
    with pytest.raises(ValueError, match=r"first axis must be the batch's.*Received: shape"):
        loop.train_step(next(iter(loop.batches(x, y, batch_size=BATCH))))
    with pytest.raises(ValueError, match=r"same number of rows.*x: \[32\], y: \[31\]"):
        acc.loop(model).batches(x, y[:31], batch_size=BATCH)
    loop = acc.loop(model)
    loop.train_step(next(iter(loop.batches(x, y, batch_size=BATCH))))
    weighted = next(iter(loop.batches({"other": x}, y, batch_size=BATCH)))
    with pytest.raises(ValueError, match="another structure than the first one"):
        loop.train_step(weighted)
    with pytest.raises(ValueError, match=r"SparseCategoricalAccuracy\('accuracy'\)"):
        acc.loop(model, metrics=["accuracy"])
    with pytest.raises(ValueError, match="needs targets"):
        loop.batches(x, batch_size=BATCH)
    if acc.num_replicas > 1:
        with pytest.raises(RuntimeError, match=r"optimizer was created outside `acc.scope\(\)`"):
            acc.loop(model, optimizer=keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("fuse", [3, 7], ids=["groups-of-3", "one-group-per-epoch"])
def test_step_groups_equal_single_steps(fuse):
    # Two replicas: fusion changes the host loop, not the replicated step (8 replicas' TF
    # graphs only cost compilation time here). 7 batches an epoch: groups of 3 end short.
    acc = Accelerator(seed=0, devices=min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8"))))
    x, y = data(ROWS)
    weights, logs = [], []
    for n in (1, fuse):
        model, _ = _models(acc)
        loop = acc.loop(model, metrics=[keras.metrics.SparseCategoricalAccuracy("accuracy")])
        batches = loop.batches(x, y, batch_size=BATCH, steps_per_execution=n)
        assert len(batches) == -(-7 // n)
        logs.append(_train(loop, x, y, steps_per_execution=n))
        loop.reset_metrics()
        for group in loop.batches(x, y, batch_size=BATCH, training=False, steps_per_execution=n):
            loop.test_step(group)
        logs.append(loop.results())
        weights.append(model.get_weights())
        # One program per kind, the short last group included; every real step counted.
        assert loop.traces == {"train": 1, "test": 1}
        iterations = keras.ops.convert_to_numpy(loop.optimizer.iterations.value)
        assert int(np.reshape(iterations, -1)[0]) == 7 * EPOCHS
    assert_weights_close(weights[0], weights[1])
    for single, fused in zip(logs[0], logs[2]):  # Each epoch's training results.
        _close(fused, single)
    _close(logs[3], logs[1])  # The evaluation.


def test_step_groups_are_for_train_and_test_steps_only():
    acc = Accelerator(seed=0, devices=1)
    model, _ = _models(acc)
    loop = acc.loop(model)
    x, y = data(ROWS)
    group = next(iter(loop.batches(x, y, batch_size=BATCH, steps_per_execution=4)))
    assert len(group) == 4
    with pytest.raises(ValueError, match="predict_step takes one batch.*StepGroup"):
        loop.predict_step(group)
    with pytest.raises(ValueError, match="'auto' or a positive integer.*Received: steps_per"):
        loop.batches(x, y, batch_size=BATCH, steps_per_execution=0)
    # "auto" in a custom loop: one batch per iteration, unless the Accelerator fixes N.
    assert loop.batches(x, y, batch_size=BATCH).steps_per_execution == 1
    fixed = Accelerator(seed=0, devices=1, steps_per_execution=5)
    assert fixed.loop(_models(fixed)[0]).batches(x, y, batch_size=BATCH).steps_per_execution == 5


def test_loop_takes_the_compiled_metrics_fresh_with_accuracy_resolved_as_compile_does():
    acc = Accelerator(seed=0, devices=min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8"))))
    with acc.scope():
        wacc = keras.metrics.SparseCategoricalAccuracy("wacc")
        model = compiled_mlp(batchnorm=False)
        model.compile(
            _optimizer(), "sparse_categorical_crossentropy", metrics=["accuracy"],
            weighted_metrics=[wacc],
        )  # fmt: skip
    x, y = data(ROWS)
    sw = np.linspace(0.2, 2.0, ROWS).astype("float32")
    loop = acc.loop(model)
    got = loop.evaluate(x, y, batch_size=BATCH, sample_weight=sw)
    want = acc.evaluate(model, x, y, batch_size=BATCH, sample_weight=sw, return_dict=True)
    assert set(got) == {"loss", "accuracy", "wacc"}, got
    _close(got, want)
    assert got["wacc"] != pytest.approx(got["accuracy"], abs=1e-4)  # The weights counted.
    # Sparse labels, three outputs: "accuracy" is SparseCategoricalAccuracy. Fresh objects:
    # the loop's state is not what fit and evaluate report.
    (accuracy,), (weighted,) = loop.metrics, loop.weighted_metrics
    assert type(accuracy) is keras.metrics.SparseCategoricalAccuracy
    assert accuracy.name == "accuracy"
    assert type(weighted) is keras.metrics.SparseCategoricalAccuracy and weighted is not wacc
    assert weighted.name == "wacc"
    model_metrics = {id(m) for m in model.metrics} | {id(wacc)}
    assert not {id(m) for m in loop.all_metrics()} & model_metrics

    # One sigmoid output and 0/1 labels: "accuracy" is BinaryAccuracy.
    with acc.scope():
        binary = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, "sigmoid")])
        binary.compile(_optimizer(), "binary_crossentropy", metrics=["accuracy"])
    labels = (x[:, 0] + 0.3 * x[:, 2] > 0).astype("float32")[:, None]
    loop = acc.loop(binary)
    got = loop.evaluate(x, labels, batch_size=BATCH)
    assert type(loop.metrics[0]) is keras.metrics.BinaryAccuracy
    twin = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1, "sigmoid")])
    twin.set_weights(binary.get_weights())
    predicted = twin.predict(x, verbose=0)
    exact = np.mean((predicted > 0.5) == (labels > 0.5))
    assert 0.1 < exact < 0.9
    assert got["accuracy"] == pytest.approx(exact, abs=1e-6)
    bce = keras.losses.binary_crossentropy(labels, predicted)
    assert got["loss"] == pytest.approx(np.mean(keras.ops.convert_to_numpy(bce)), rel=1e-5)

    # Metrics per output cannot apply to the loop's whole output: refused, with what to pass.
    with acc.scope():
        binary.compile(
            _optimizer(), "binary_crossentropy", metrics={binary.layers[-1].name: ["accuracy"]}
        )
    with pytest.raises(ValueError, match="metrics per output"):
        acc.loop(binary)
