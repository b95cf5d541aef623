"""Host-loop fusion (`steps_per_execution`): faster host loops, the same training, exact
callbacks. On two replicas: what fusion changes is the host loop, not the step, and a
replicated step is what Keras's own fused TF loop breaks on (keras-team/keras#19246); eight
replicas' TF graphs would cost minutes of compilation on this suite's 2 cores."""

import os

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.adapter import fusion
from keras_accel.callbacks import BackupAndRestore, History, LearningRateScheduler
from keras_accel.schedules import PiecewiseConstant
from keras_accel.utils import process

BATCH = 16
ROWS = 600  # 38 steps per epoch: auto fuses 32, then a last group of 6 (and a padded batch).
DEVICES = min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8")))
# JAX runs the very same jitted step N times: equal to float32 precision. TensorFlow runs N
# steps as the body of one graph's while-loop, which Grappler optimizes differently from the
# one-step graph: last-bit rounding differs per step, and momentum carries it (measured
# <= 4e-5 after 80 steps). A learning rate applied a group late would move the weights by
# ~1e-2 here, far outside either tolerance.
TOLERANCE = 1e-6 if keras.backend.backend() == "jax" else 1e-4


def _data(rows=ROWS, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(rows, 1))).astype("float32")
    return x, y


def _model(acc, **compile_args):
    keras.utils.set_random_seed(0)
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9), "mse", metrics=["mae"], **compile_args
        )
    return model


def _schedule():
    return PiecewiseConstant([0.05, 0.01, 0.002], boundaries=[0.3, 0.6], unit="fraction")


def _fit(fuse, callbacks, epochs=3, rows=ROWS, validation=True, verbose=0, **compile_args):
    acc = Accelerator(seed=0, devices=DEVICES, steps_per_execution=fuse)
    model = _model(acc, **compile_args)
    x, y = _data(rows)
    vx, vy = _data(100, seed=1)
    history = acc.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        verbose=verbose,
        callbacks=callbacks,
        validation_data=(vx, vy) if validation else None,
    )
    return acc, model, history


def test_a_per_step_schedule_gives_the_same_training_fused_and_unfused():
    plain = [LearningRateScheduler(_schedule(), update_freq="step"), History()]
    fused = [LearningRateScheduler(_schedule(), update_freq="step"), History()]
    acc1, model1, history1 = _fit(1, plain, epochs=2)
    acc32, model32, history32 = _fit("auto", fused, epochs=2)

    assert plain[1].steps_per_execution == 1 and fused[1].steps_per_execution == 32
    assert fused[1].to_dict()["steps_per_execution"] == 32
    # The rate moved at every step inside the fused groups: the boundaries (steps 23 and
    # 46 of 76) fall inside groups, and the weights equal those of one step per call.
    for a, b in zip(model1.get_weights(), model32.get_weights()):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    for key in ("loss", "mae", "val_loss", "val_mae", "learning_rate"):
        np.testing.assert_allclose(history1.history[key], history32.history[key], rtol=TOLERANCE)
    assert history32.history["learning_rate"] == pytest.approx([0.01, 0.002])
    # No compilation after warm-up, the last group of 6 steps included.
    assert acc1.num_recompiles == 0 and acc32.num_recompiles == 0
    # Nothing left behind: Keras's default, and the rate variable a step-by-step run leaves.
    assert model32.steps_per_execution == 1
    assert isinstance(model32.optimizer._learning_rate, keras.Variable)
    rate = keras.ops.convert_to_numpy(model32.optimizer._learning_rate.value)
    assert float(np.reshape(rate, -1)[0]) == pytest.approx(0.002)


def test_a_callback_with_batch_hooks_sees_every_batch_and_fusion_says_why_it_is_off(capsys):
    seen = []
    hooks = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    history = History()
    acc = Accelerator(seed=0, devices=DEVICES)
    model = _model(acc)
    x, y = _data()
    acc.fit(model, x, y, batch_size=BATCH, epochs=2, verbose=2, callbacks=[hooks, history])
    assert seen == list(range(38)) * 2
    assert history.steps_per_execution == 1
    out = capsys.readouterr().out
    assert "no host-loop fusion" in out and "LambdaCallback" in out, out
    assert "on_train_batch_end" in out


@pytest.mark.parametrize(
    "callback",
    [
        lambda: LearningRateScheduler(lambda step: 0.05 if step < 40 else 0.01, update_freq="step"),
        lambda: History(per_step=True),
    ],
    ids=["python-schedule", "per-step-history"],
)
def test_callbacks_that_need_every_step_bound_fusion_to_one(callback):
    acc = Accelerator(seed=0, devices=DEVICES)
    model = _model(acc)
    n, why = fusion.choose(acc.steps_per_execution, model, "train", 38, [callback()])
    assert n == 1 and "needs every batch" in why, why


class _Recording(BackupAndRestore):
    def save(self, epoch, batch, logs=None, finished_epoch=None):
        self.saved = getattr(self, "saved", []) + [(epoch, batch)]
        return super().save(epoch, batch, logs=logs, finished_epoch=finished_epoch)


def test_backups_fall_on_the_same_steps_fused_and_unfused(tmp_path):
    # 40 steps per epoch and a backup every 8 steps: auto fuses 8 steps per call.
    rows = 40 * BATCH
    plain = _Recording(str(tmp_path / "plain"), save_freq=8, delete_checkpoint=False)
    fused = _Recording(str(tmp_path / "fused"), save_freq=8, delete_checkpoint=False)
    _, model1, history1 = _fit(1, [plain], epochs=2, rows=rows, validation=False)
    acc, model8, history8 = _fit("auto", [fused], epochs=2, rows=rows, validation=False)
    n, _ = fusion.choose("auto", model8, "train", 40, [fused])
    assert n == 8
    assert plain.saved == fused.saved and len(plain.saved) == 10, plain.saved
    assert len(fused.checkpoints()) == len(plain.checkpoints())
    for a, b in zip(model1.get_weights(), model8.get_weights()):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(history1.history["loss"], history8.history["loss"], rtol=TOLERANCE)


def test_validation_batch_hooks_count_too():
    hooks = keras.callbacks.LambdaCallback(on_test_batch_end=lambda batch, logs: None)
    model = _model(Accelerator(seed=0, devices=DEVICES))
    assert fusion.choose("auto", model, "train", 38, [hooks])[0] == 32
    n, why = fusion.choose("auto", model, "train", 38, [hooks], validating=True)
    assert n == 1 and "on_test_batch_end" in why, why


def test_explicit_steps_per_execution_wins_and_stays_the_users(progress):
    seen = []
    hooks = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(batch)
    )
    acc, model, _ = _fit("auto", [hooks], epochs=1, validation=False, steps_per_execution=4)
    assert seen[:3] == [3, 7, 11] and model.steps_per_execution == 4
    seen.clear()
    acc, model, _ = _fit(5, [hooks], epochs=1, validation=False, verbose=1)
    assert seen[:3] == [4, 9, 14] and model.steps_per_execution == 1
    assert acc.num_recompiles == 0
    # 38 steps in groups of 5: the callbacks see Keras's numbering (the last group "ends"
    # at 39), the progress bar stops at the epoch's 38 steps.
    assert seen[-1] == 39 and max(progress) == (38, 38), progress


@pytest.fixture
def progress(monkeypatch):
    """Every step count Keras's progress bars show, with their targets (`(current, target)`)."""
    shown = []
    update = keras.utils.Progbar.update

    def spy(bar, current, values=None, finalize=None):
        shown.append((current, bar.target))
        return update(bar, current, values, finalize)

    monkeypatch.setattr(keras.utils.Progbar, "update", spy)
    return shown


def test_fused_evaluate_equals_unfused_and_predict_returns_every_row(
    capsys, caplog, monkeypatch, progress
):
    x, y = _data()
    results = {}
    for spe in (1, "auto"):
        acc = Accelerator(seed=0, devices=DEVICES, steps_per_execution=spe)
        model = _model(acc)
        verbose = 1 if spe == "auto" else 0
        results[spe] = (
            acc.evaluate(model, x, y, batch_size=BATCH, verbose=verbose, return_dict=True),
            acc.predict(model, x, batch_size=BATCH, verbose=0),
        )
        assert fusion.choose(spe, model, "test", 38, [])[0] == (1 if spe == 1 else 32)
    assert results[1][0] == pytest.approx(results["auto"][0], rel=1e-6)
    assert results["auto"][1].shape == (ROWS, 1)
    np.testing.assert_allclose(results[1][1], results["auto"][1], rtol=1e-6)
    # 38 steps in groups of 32: Keras numbers the last group's end 63; the bar stops at 38.
    assert progress and all(current <= target for current, target in progress), progress
    assert (38, 38) in progress, progress
    # Another evaluation of the same model, 19 steps (fused 19): its note was said already.
    acc.evaluate(model, x[:300], y[:300], batch_size=BATCH, verbose=1)
    notes = [line for line in capsys.readouterr().out.splitlines() if "keras_accel:" in line]
    assert len(notes) == 1 and "steps_per_execution=32" in notes[0], notes
    # The per-replica data sets' auto-shard policy is set once, not changed (TensorFlow).
    assert "Changing the value of option" not in caplog.text
    # In a process other than the chief, nothing is printed (`keras-accel launch`).
    monkeypatch.setattr(process, "is_chief", lambda: False)
    acc.evaluate(model, x, y, batch_size=BATCH, verbose=1)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("value", [0, -2, 2.5, "fast", True])
def test_a_bad_steps_per_execution_names_what_was_received(value):
    with pytest.raises(ValueError, match=r"'auto' or a positive integer.*Received: steps_per_"):
        Accelerator(steps_per_execution=value)


def _two_outputs(acc=None):
    """A functional model with a classification and a regression output (per-output losses,
    loss weights and a per-output metric), built from seed 0 in `acc`'s scope or plainly."""

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(8, activation="relu")(inputs)
        outputs = {
            "cls": keras.layers.Dense(3, name="cls")(hidden),
            "reg": keras.layers.Dense(1, name="reg")(hidden),
        }
        model = keras.Model(inputs, outputs)
        model.compile(
            keras.optimizers.SGD(0.1),
            loss={
                "cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                "reg": "mse",
            },
            loss_weights={"cls": 1.0, "reg": 0.5},
            metrics={"cls": ["accuracy"]},
        )
        return model

    if acc is None:
        return build()
    with acc.scope():
        return build()


def _two_output_data(rows):
    x, reg = _data(rows)
    cls = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    return x, {"cls": cls, "reg": reg}


def test_per_output_losses_of_fused_steps_equal_plain_keras_with_and_without_padding(backend):
    # Keras weights each batch's per-output loss by the static size of y_pred's first axis
    # (once where it is unknown): the fused loop body's batches must have the first
    # call site's static shapes, or cls_loss/reg_loss count batches, not rows.
    acc = Accelerator(devices=DEVICES)
    ours, plain = _two_outputs(acc), _two_outputs()
    for a, b in zip(ours.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    x, y = _two_output_data(256)  # 8 batches of 32: auto fuses all 8 in one call.
    assert fusion.choose("auto", ours, "train", 8, [])[0] == 8
    keys = ("loss", "cls_loss", "reg_loss", "cls_accuracy")
    history = acc.fit(ours, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    want = plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert set(keys) <= set(history.history), history.history
    for key in keys:
        np.testing.assert_allclose(
            history.history[key], want.history[key], rtol=1e-5, atol=1e-6, err_msg=key
        )
    got = acc.evaluate(ours, x, y, batch_size=32, verbose=0, return_dict=True)
    expected = plain.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    for key in keys:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-5, atol=1e-6, err_msg=key)

    # 230 rows: 7 batches of 32 and one of 6 (padded to 32 here). The exact per-row means,
    # from the model's predictions and Keras's loss functions.
    x, y = _two_output_data(230)
    plain.set_weights(ours.get_weights())
    predicted = plain.predict(x, batch_size=32, verbose=0)
    cls_loss = np.mean(
        keras.ops.convert_to_numpy(
            keras.losses.sparse_categorical_crossentropy(y["cls"], predicted["cls"], True)
        )
    )
    reg_loss = np.mean(
        keras.ops.convert_to_numpy(keras.losses.mean_squared_error(y["reg"], predicted["reg"]))
    )
    accuracy = np.mean(np.argmax(predicted["cls"], axis=-1) == y["cls"])
    exact = {
        "loss": cls_loss + 0.5 * reg_loss,
        "cls_loss": cls_loss,
        "reg_loss": reg_loss,
        "cls_accuracy": accuracy,
    }
    assert not np.isclose(cls_loss, expected["cls_loss"], rtol=1e-3)  # Another model now.
    got = acc.evaluate(ours, x, y, batch_size=32, verbose=0, return_dict=True)
    for key in keys:
        np.testing.assert_allclose(got[key], exact[key], rtol=1e-5, atol=1e-6, err_msg=key)
    if backend == "jax":  # Keras on TF averages the batch means (the last batch's size unknown).
        expected = plain.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
        for key in keys:
            np.testing.assert_allclose(expected[key], exact[key], rtol=1e-5, atol=1e-6, err_msg=key)


class _SeesFusion(keras.callbacks.Callback):
    """The steps per host call each fit, evaluate or predict ran (no batch hooks)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_begin(self, logs=None):
        self.seen.append(("train", self.model.steps_per_execution))

    def on_test_begin(self, logs=None):
        self.seen.append(("test", self.model.steps_per_execution))


@pytest.mark.torch
def test_auto_holds_at_most_auto_bytes_of_array_batches_per_call(monkeypatch):
    # A batch of x (8 float32) and y (1 float32) is 16 * 36 bytes: with room for 5 batches
    # a group, a fit, its validation and an evaluate fuse 5 steps, and train as unfused.
    batch_bytes = BATCH * 9 * 4
    monkeypatch.setattr(fusion, "AUTO_BYTES", 5 * batch_bytes)
    seen = _SeesFusion()
    acc, fused, history = _fit("auto", [seen], epochs=2)
    x, y = _data(100, seed=1)
    acc.evaluate(fused, x, y, batch_size=BATCH, verbose=0, callbacks=[seen])
    # The fit, its validation after each of 2 epochs, then the evaluate.
    assert seen.seen == [("train", 5)] + [("test", 5)] * 3, seen.seen
    _, plain, plain_history = _fit(1, [], epochs=2)
    for a, b in zip(plain.get_weights(), fused.get_weights()):
        np.testing.assert_allclose(a, b, rtol=TOLERANCE, atol=TOLERANCE)
    np.testing.assert_allclose(
        plain_history.history["val_loss"], history.history["val_loss"], rtol=TOLERANCE
    )
    # With a callback's period the group is the largest divisor of it within the bound, and
    # the note says both why.
    model = _model(Accelerator(seed=0, devices=DEVICES))
    backup = BackupAndRestore("unused", save_freq=6)
    n, why = fusion.choose("auto", model, "train", 36, [backup], batch_bytes=batch_bytes)
    assert n == 3, why
    assert "batches of 576 bytes, at most 2.81 KiB" in why and "BackupAndRestore" in why, why
    # A batch larger than the bound alone: one step per call.
    n, why = fusion.choose("auto", model, "train", 36, [], batch_bytes=6 * batch_bytes)
    assert n == 1 and "batches of 3.38 KiB" in why, why
    assert fusion.choose("auto", model, "train", 36, [], batch_bytes=None)[0] == 32
