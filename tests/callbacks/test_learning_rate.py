"""LearningRateScheduler: the rate each step really used, on 8 replicas, on both backends."""

import logging
import math
import warnings

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import History, LearningRateScheduler
from keras_accel.callbacks.learning_rate import host_step
from keras_accel.schedules import PiecewiseConstant, WarmupCosine
from tests.callbacks._probe import UsedRates, prediction_loss, probe_data, probe_model
from tests.helpers import FEW_REPLICAS

ROWS, BATCH, EPOCHS = 50, 16, 2  # 4 steps per epoch; the last batch is padded.


def test_step_schedule_object_on_an_optimizer_built_with_a_schedule(num_devices):
    """Accelerator.fit, 8 replicas: a keras_accel schedule that needs the training length,
    applied every step, although the optimizer was built with a Keras schedule (which makes
    Keras's own callback raise a TypeError)."""
    acc = Accelerator(seed=0)
    assert acc.num_replicas == num_devices
    with acc.scope():
        decay = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
        model = probe_model(keras.optimizers.SGD(decay))
    model.optimizer.build(model.trainable_variables)
    paths_before = [v.path for v in model.optimizer.variables]
    schedule = WarmupCosine(0.1, warmup_steps=3)
    used, history = UsedRates(), History(per_step=True)
    callbacks = [LearningRateScheduler(schedule, update_freq="step"), used, history]
    result = acc.fit(
        model, *probe_data(ROWS), batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=callbacks
    )
    steps_per_epoch = math.ceil(ROWS / BATCH)
    bound = schedule.with_total_steps(EPOCHS * steps_per_epoch, steps_per_epoch=steps_per_epoch)
    expected = [float(bound(step)) for step in range(EPOCHS * steps_per_epoch)]
    np.testing.assert_allclose(used.rates, expected, atol=2e-7)
    assert used.steps == list(range(EPOCHS * steps_per_epoch))
    # The applied rate is in the logs: per step, and per epoch (the epoch's last step).
    assert [row["learning_rate"] for row in history.steps] == pytest.approx(expected, abs=1e-7)
    assert result is history and model.history is history
    assert history.history["learning_rate"] == pytest.approx(
        [expected[steps_per_epoch - 1], expected[-1]], abs=1e-7
    )
    # The optimizer gets its own schedule back, and its variables are those it had.
    assert model.optimizer._learning_rate is decay
    assert [v.path for v in model.optimizer.variables] == paths_before


def test_epoch_schedule_of_epoch_and_rate_with_plain_model_fit_on_replicas():
    """Keras's behaviour, on a model built in the scope and trained with plain `model.fit`
    (the seed's TPU model, where Keras 2's callback did nothing): `schedule(epoch, lr)` at
    each epoch's start, `learning_rate` in the logs."""
    acc = Accelerator(seed=0)
    with acc.scope():
        model = probe_model(keras.optimizers.SGD(0.2))
        used = UsedRates()
        result = model.fit(
            *probe_data(32),
            batch_size=BATCH,
            epochs=3,
            verbose=0,
            callbacks=[LearningRateScheduler(lambda epoch, lr: lr * 0.5), used],
        )
    np.testing.assert_allclose(used.rates, [0.1, 0.1, 0.05, 0.05, 0.025, 0.025], atol=2e-7)
    assert result.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.025])


def test_step_function_with_plain_model_fit():
    """A plain function of the global step, one device."""
    model = probe_model()
    used = UsedRates()
    model.fit(
        *probe_data(48),
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[LearningRateScheduler(lambda step: 0.1 / (1 + step), update_freq="step"), used],
    )
    np.testing.assert_allclose(used.rates, [0.1 / (1 + s) for s in range(6)], atol=2e-7)


# ---------------------------------------------------------------------------------------
# Driven by hand, as a custom training loop would: no compilation, so these are fast.


def _driven(callback, model=None, epochs=2, steps=5):
    model = model or probe_model()
    model.optimizer.build(model.trainable_variables)
    callback.set_model(model)
    callback.set_params({"epochs": epochs, "steps": steps, "verbose": 0})
    callback.on_train_begin()
    return model


def _rate(model):
    return float(model.optimizer._learning_rate.numpy())


def test_continues_from_the_optimizer_step_after_a_resume():
    schedule = PiecewiseConstant([0.1, 0.01], boundaries=[0.5], unit="fraction")
    callback = LearningRateScheduler(schedule, update_freq="step")
    model = _driven(callback)
    model.optimizer.iterations.assign(5)  # What BackupAndRestore restores.
    callback.on_epoch_begin(1)
    callback.on_train_batch_begin(0)
    assert _rate(model) == pytest.approx(0.01)  # Step 5 of 10: after the 50% boundary.
    logs = {}
    callback.on_train_batch_end(0, logs)
    assert logs["learning_rate"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    "value, shown",
    [(float("nan"), "nan"), ("0.1", "'0.1'"), (None, "None"), (-0.5, "-0.5"), ([0.1, 0.2], "")],
)
def test_bad_values_name_the_step_and_the_value(value, shown):
    callback = LearningRateScheduler(lambda step: value if step == 3 else 0.1, update_freq="step")
    model = _driven(callback)
    callback.on_epoch_begin(0)
    for batch in range(3):
        callback.on_train_batch_begin(batch)
    with pytest.raises(ValueError, match=r"step 3") as error:
        callback.on_train_batch_begin(3)
    assert f"value={shown}" in str(error.value)
    assert _rate(model) == pytest.approx(0.1)  # The bad value was never applied.


def test_bad_epoch_value_names_the_epoch():
    callback = LearningRateScheduler(lambda epoch, lr: float("inf"))
    _driven(callback)
    with pytest.raises(ValueError, match=r"for epoch 0.*value=inf"):
        callback.on_epoch_begin(0)


def test_a_type_error_inside_the_schedule_is_not_retried():
    calls = []

    def schedule(epoch, lr):
        calls.append(epoch)
        raise TypeError("bug inside the user's schedule")

    callback = LearningRateScheduler(schedule)
    _driven(callback)
    with pytest.raises(TypeError, match="bug inside"):
        callback.on_epoch_begin(0)
    assert calls == [0]  # Called once: Keras's would call schedule(epoch) again.


def test_one_argument_epoch_schedule():
    callback = LearningRateScheduler(lambda epoch: 0.3 / (epoch + 1))
    model = _driven(callback)
    callback.on_epoch_begin(2)
    assert _rate(model) == pytest.approx(0.1)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="must be callable"):
        LearningRateScheduler(0.1)
    with pytest.raises(ValueError, match="update_freq"):
        LearningRateScheduler(lambda e: 0.1, update_freq="batch")
    with pytest.raises(TypeError, match=r"schedule\(index\)"):
        LearningRateScheduler(lambda a, b, c: 0.1)


def test_schedule_needing_the_length_without_one_is_a_clear_error():
    schedule = PiecewiseConstant([0.1, 0.01], boundaries=[0.5], unit="fraction")
    callback = LearningRateScheduler(schedule, update_freq="step")
    with pytest.raises(ValueError, match="steps_per_epoch"):
        _driven(callback, steps=None)


def test_steps_per_execution_warns():
    model = probe_model()
    model.compile(keras.optimizers.SGD(0.1), loss="mse", steps_per_execution=4)
    with pytest.warns(UserWarning, match="once per 4 steps"):
        _driven(LearningRateScheduler(lambda step: 0.1, update_freq="step"), model=model)


def test_keras_raises_where_this_one_works(tmp_path):
    # The seed's complaint, in Keras 3: a schedule-built optimizer's rate cannot be set.
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 10)
    model = probe_model(keras.optimizers.Adam(schedule))
    with pytest.raises(TypeError):
        model.optimizer.learning_rate = 0.05
    callback = LearningRateScheduler(lambda epoch: 0.05)
    _driven(callback, model=model)
    callback.on_epoch_begin(0)
    assert _rate(model) == pytest.approx(0.05)
    # The rate variable sits where a float-built optimizer has it, so the saved optimizer
    # state loads back into the optimizer rebuilt from the saved config.
    paths = [v.path for v in model.optimizer.variables]
    assert paths[:2] == ["adam/iteration", "adam/learning_rate"] and len(set(paths)) == len(paths)
    model.save(str(tmp_path / "m.keras"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # Keras warns when it skips variables.
        loaded = keras.saving.load_model(
            str(tmp_path / "m.keras"), custom_objects={"prediction_loss": prediction_loss}
        )
    assert [float(np.asarray(v.numpy()).ravel()[0]) for v in loaded.optimizer.variables] == [
        float(np.asarray(v.numpy()).ravel()[0]) for v in model.optimizer.variables
    ]


def test_loss_scale_optimizer_sets_the_wrapped_rate():
    # Mixed float16 wraps the optimizer; the rate the step uses is the inner one's.
    schedule = keras.optimizers.schedules.CosineDecay(0.1, 10)
    model = probe_model(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(schedule)))
    callback = LearningRateScheduler(lambda epoch: 0.05)
    _driven(callback, model=model)
    callback.on_epoch_begin(0)
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(0.05)


# ---------------------------------------------------------------------------------------
# Keras's messages (verbose=1), where Keras sends them.


def test_verbose_prints_keras_message_every_epoch(capsys):
    callback = LearningRateScheduler(lambda epoch: 0.5, verbose=1)
    _driven(callback)
    callback.on_epoch_begin(0)
    callback.on_epoch_begin(1)  # Same rate: Keras prints every epoch all the same.
    assert capsys.readouterr().out == (
        "\nEpoch 1: LearningRateScheduler setting learning rate to 0.5.\n"
        "\nEpoch 2: LearningRateScheduler setting learning rate to 0.5.\n"
    )


def test_verbose_goes_to_absl_logging_when_interactive_logging_is_off(capsys, caplog):
    callback = LearningRateScheduler(lambda epoch, lr: 0.25, verbose=1)
    _driven(callback)
    keras.config.disable_interactive_logging()
    try:
        with caplog.at_level(logging.INFO, logger="absl"):
            callback.on_epoch_begin(2)
    finally:
        keras.config.enable_interactive_logging()
    assert capsys.readouterr().out == ""
    assert caplog.messages == ["\nEpoch 3: LearningRateScheduler setting learning rate to 0.25."]


def test_verbose_in_step_mode_prints_when_the_rate_changes(capsys):
    callback = LearningRateScheduler(
        lambda step: 0.1 if step < 2 else 0.01, update_freq="step", verbose=1
    )
    _driven(callback)
    callback.on_epoch_begin(0)
    for batch in range(4):
        callback.on_train_batch_begin(batch)
    assert capsys.readouterr().out == (
        "\nStep 0: LearningRateScheduler setting learning rate to 0.1.\n"
        "\nStep 2: LearningRateScheduler setting learning rate to 0.01.\n"
    )


def test_verbose_fit_prints_keras_message(capsys):
    """A whole `fit` with verbose=1 (Keras 3.15's own test of this crashed here before)."""
    model = probe_model(keras.optimizers.SGD(0.2))
    model.fit(
        *probe_data(16),
        batch_size=BATCH,
        epochs=2,
        verbose=0,
        callbacks=[LearningRateScheduler(lambda epoch, lr: lr / 2, verbose=1)],
    )
    # As Keras prints it: the schedule's value, from the float32 rate read as a float.
    first = float(np.float32(0.2)) / 2
    second = float(np.float32(first)) / 2
    assert capsys.readouterr().out == (
        f"\nEpoch 1: LearningRateScheduler setting learning rate to {first}.\n"
        f"\nEpoch 2: LearningRateScheduler setting learning rate to {second}.\n"
    )


def test_bad_value_starts_with_keras_wording():
    callback = LearningRateScheduler(lambda epoch: "fast")
    _driven(callback)
    with pytest.raises(
        ValueError,
        match=r"^The output of the `schedule` function should be a "
        r"float\. Got: fast\. .*for epoch 0",
    ):
        callback.on_epoch_begin(0)


# ---------------------------------------------------------------------------------------
# An optimizer built with a Keras schedule, stepped on 8 replicas.


@pytest.mark.parametrize("how", ["acc.fit", "model.fit in scope"])
def test_step_mode_on_a_schedule_built_optimizer_on_replicas(how, num_devices):
    """The rate of every step, read back from the weights, on 8 replicas: the optimizer's
    ExponentialDecay is replaced by a variable, computed from one host-side step count (a
    MirroredVariable under tf.distribute), then set before each step."""
    acc = Accelerator(seed=0)
    assert acc.num_replicas == num_devices
    with acc.scope():
        decay = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)
        model = probe_model(keras.optimizers.SGD(decay))
    used = UsedRates()
    callbacks = [LearningRateScheduler(lambda step: 0.1 / (1 + step), update_freq="step"), used]
    if how == "acc.fit":
        acc.fit(model, *probe_data(40), batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    else:
        with acc.scope():
            model.fit(*probe_data(32), batch_size=BATCH, epochs=2, verbose=0, callbacks=callbacks)
    steps = len(used.rates)
    assert steps == (6 if how == "acc.fit" else 4)  # 3 (last one padded) or 2 steps an epoch.
    assert used.steps == list(range(steps))
    np.testing.assert_allclose(used.rates, [0.1 / (1 + s) for s in range(steps)], atol=2e-7)


def test_host_step_reads_one_count_of_replicated_copies():
    assert host_step(np.array(7)) == 7
    assert host_step(np.array([5, 5, 5, 5, 5, 5, 5, 5])) == 5  # One copy per replica.
    with pytest.raises(ValueError, match=r"the same on every replica.*\[5, 6\]"):
        host_step(np.array([5, 6]))


# ---------------------------------------------------------------------------------------
# What a fit leaves on the optimizer: the schedule it was built with comes back.


def _decay():
    return keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.5)


class _Functions(keras.callbacks.Callback):
    """The train function each fit ran with (no batch hook, which would stop fusion)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(self._model.train_function)


def test_plain_fit_gives_the_optimizer_its_schedule_back_and_the_next_fit_follows_it():
    decay = _decay()
    model = probe_model(keras.optimizers.SGD(decay))
    model.optimizer.build(model.trainable_variables)
    paths = [v.path for v in model.optimizer.variables]
    model.fit(*probe_data(32), batch_size=16, epochs=1, verbose=0)
    own = model.train_function
    schedule = LearningRateScheduler(lambda step: 0.01, update_freq="step")
    model.fit(*probe_data(32), batch_size=16, epochs=1, verbose=0, callbacks=[schedule])
    assert model.optimizer._learning_rate is decay
    assert [v.path for v in model.optimizer.variables] == paths
    assert model.train_function is own  # Traced around the schedule: still right.
    # A fit without the scheduler follows the schedule again, from the optimizer's count (4).
    used = UsedRates()
    model.fit(*probe_data(32), batch_size=16, epochs=1, verbose=0, callbacks=[used])
    np.testing.assert_allclose(used.rates, [0.5 * 0.5**4, 0.5 * 0.5**5], rtol=1e-5)


@pytest.mark.parametrize("fuse", [1, "auto"], ids=["step by step", "fused"])
def test_acc_fit_gives_the_schedule_back_and_the_next_call_reuses_its_steps(fuse):
    acc = Accelerator(seed=0, devices=FEW_REPLICAS, steps_per_execution=fuse)
    decay = _decay()
    with acc.scope():
        model = probe_model(keras.optimizers.SGD(decay))
    model.optimizer.build(model.trainable_variables)
    paths = [v.path for v in model.optimizer.variables]
    functions, history = _Functions(), History()
    for _ in range(2):
        schedule = LearningRateScheduler(
            PiecewiseConstant([0.1, 0.05], boundaries=[2]), update_freq="step"
        )
        acc.fit(
            model,
            *probe_data(64),
            batch_size=16,
            epochs=1,
            verbose=0,
            callbacks=[schedule, functions, history],
        )
        assert model.optimizer._learning_rate is decay
        assert [v.path for v in model.optimizer.variables] == paths
    # The second fit ran the step the first compiled (the same rate variable installed).
    assert functions.seen[0] is functions.seen[1] and acc.num_recompiles == 0
    assert history.steps_per_execution == (1 if fuse == 1 else 4)


def test_acc_fit_that_raises_still_gives_the_schedule_back():
    class Crash(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("stop here")

    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    decay = _decay()
    with acc.scope():
        model = probe_model(keras.optimizers.SGD(decay))
    schedule = LearningRateScheduler(lambda step: 0.01, update_freq="step")
    with pytest.raises(RuntimeError, match="stop here"):
        acc.fit(
            model,
            *probe_data(32),
            batch_size=16,
            epochs=2,
            verbose=0,
            callbacks=[schedule, Crash()],
        )
    assert model.optimizer._learning_rate is decay
    assert not any("learning_rate" in v.path for v in model.optimizer.variables)
