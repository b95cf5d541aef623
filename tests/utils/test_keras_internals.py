"""The Keras internals keras_accel relies on: all present in this Keras, found by what they are
(not by a class path Keras may rename), and a missing one is an error that names it and the
Keras version, never a silent no-op."""

import importlib
import inspect
import sys

import keras
import pytest

from keras_accel.utils import keras_internals

ON_TF = keras.backend.backend() == "tensorflow"
pytestmark = pytest.mark.torch  # The internals are checked on every backend.


@pytest.fixture(autouse=True)
def _fresh_check():
    """`check()` is cached per process: each test sees (and leaves) a fresh one."""
    keras_internals.check.cache_clear()
    yield
    keras_internals.check.cache_clear()


def _listed() -> list:
    return [*keras_internals.REQUIRED, *(keras_internals.REQUIRED_TENSORFLOW if ON_TF else [])]


def test_every_listed_internal_exists_in_the_installed_keras():
    keras_internals.check()


@pytest.mark.parametrize("internal", _listed(), ids=lambda i: f"{i.where}.{i.name}")
def test_each_listed_internal_resolves(internal):
    assert hasattr(internal.find(), internal.name)


def _without(monkeypatch, module: str, *names: str) -> None:
    target = importlib.import_module(module)
    for name in names:
        monkeypatch.delattr(target, name, raising=False)


def test_a_renamed_trainer_class_still_resolves(monkeypatch):
    """Keras 3.16 renamed `keras.src.trainers.trainer.Trainer` to `BaseTrainer` (and the TF
    backend's `TensorFlowTrainer` to `Trainer`): the internals are found through
    `keras.Model`'s MRO, so no class name matters."""
    _without(monkeypatch, "keras.src.trainers.trainer", "Trainer", "BaseTrainer")
    backend = keras.backend.backend()
    _without(
        monkeypatch,
        f"keras.src.backend.{backend}.trainer",
        "Trainer",
        "TensorFlowTrainer",
        "JAXTrainer",
    )
    keras_internals.check.__wrapped__()
    keras_internals.check()


@pytest.mark.skipif(not ON_TF, reason="the TensorFlow backend's classes")
def test_tf_classes_are_found_through_public_classes(monkeypatch):
    trainer = next(c for c in keras.Model.__mro__ if "make_train_function" in vars(c))
    optimizer = next(
        c for c in keras.optimizers.Optimizer.__mro__ if "_all_reduce_sum_gradients" in vars(c)
    )
    _without(monkeypatch, "keras.src.backend.tensorflow.optimizer", "TFOptimizer")
    _without(monkeypatch, "keras.src.backend.tensorflow.trainer", "TensorFlowTrainer", "Trainer")
    keras_internals.check()
    listed = next(
        i for i in keras_internals.REQUIRED_TENSORFLOW if i.name == "_all_reduce_sum_gradients"
    )
    assert listed.find() is optimizer
    assert issubclass(keras.optimizers.Adam, optimizer)
    assert keras_internals.tf_trainer_module() is sys.modules[trainer.__module__]
    # What the TF step functions call is what keras_accel's own step functions reduce with.
    make_train_function = inspect.unwrap(trainer.make_train_function)
    assert make_train_function.__globals__ is vars(keras_internals.tf_trainer_module())
    assert (
        keras_internals.reduce_per_replica()
        is make_train_function.__globals__["reduce_per_replica"]
    )


def test_what_is_used_is_what_was_checked():
    """The accessors return what `check()` resolved, found the same way."""
    config = sys.modules[keras.config.backend.__module__]
    assert keras_internals.keras_home() == config.keras_home()
    keras_internals.set_global_seed(1234)
    rng_utils = sys.modules[keras.utils.set_random_seed.__module__]
    global_state = sys.modules[keras.utils.clear_session.__module__]
    assert global_state.get_global_attribute(rng_utils.GLOBAL_RANDOM_SEED) == 1234
    assert keras_internals.global_seed_generator() is None


def _raises_with(monkeypatch, internal) -> str:
    monkeypatch.setattr(keras_internals, "REQUIRED", [*keras_internals.REQUIRED, internal])
    with pytest.raises(keras_internals.KerasInternalsError) as caught:
        keras_internals.check()
    return str(caught.value)


def test_a_missing_internal_names_itself_and_the_keras_version(monkeypatch):
    message = _raises_with(
        monkeypatch,
        keras_internals.Internal(
            "keras.layers.Dense", "_renamed_in_keras_9", "testing", lambda: keras.layers.Dense
        ),
    )
    assert "`_renamed_in_keras_9` of keras.layers.Dense (testing)" in message
    assert f"Keras {keras.__version__} does not have" in message
    assert f"tested with Keras {keras_internals.TESTED_KERAS}" in message
    assert "pip install -c constraints.txt" in message


def test_a_missing_holder_is_the_same_error(monkeypatch):
    """The class or module that held an internal is gone (not only the attribute)."""

    def gone():
        return importlib.import_module("keras.src.no_such_module_in_keras_9")

    message = _raises_with(
        monkeypatch, keras_internals.Internal("a removed module", "anything", "testing", gone)
    )
    assert "`anything` of a removed module (testing)" in message
    assert f"Keras {keras.__version__} does not have" in message


def test_check_runs_once_and_is_cheap_to_call_again(monkeypatch):
    calls = []
    internal = keras_internals.Internal(
        "keras.Model", "fit", "testing", lambda: calls.append(1) or keras.Model
    )
    monkeypatch.setattr(keras_internals, "REQUIRED", [*keras_internals.REQUIRED, internal])
    for _ in range(3):
        keras_internals.check()
    assert calls == [1]


def test_require_on_an_instance():
    layer = keras.layers.BatchNormalization()
    assert keras_internals.require(layer, "_moments", "why") == layer._moments
    with pytest.raises(keras_internals.KerasInternalsError, match="`_gone` of BatchNormalization"):
        keras_internals.require(layer, "_gone", "why")


def _compiled_model():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
    return model


def test_the_instance_accessors_read_what_keras_holds():
    model = _compiled_model()
    optimizer = model.optimizer
    assert keras_internals.compile_loss(model) is model._compile_loss
    assert keras_internals.compile_metrics(model) is model._compile_metrics
    assert keras_internals.compiled_metric_arguments(model) == (["mae"], None)
    assert keras_internals.loss_tracker(model) is model._loss_tracker
    assert keras_internals.initial_epoch(model) is None
    assert keras_internals.learning_rate_of(optimizer) is optimizer._learning_rate
    assert keras_internals.optimizer_variables(optimizer) is optimizer._variables
    assert keras_internals.iteration_variable(optimizer) is optimizer._iterations
    assert keras_internals.inbound_nodes(model.layers[0]) == model.layers[0]._inbound_nodes
    loss = keras.losses.MeanSquaredError()
    assert keras_internals.wrapped_function(loss) is loss.fn
    assert keras_internals.wrapped_kwargs(loss) == loss._fn_kwargs
    metric = keras.metrics.MeanMetricWrapper(keras.losses.mean_absolute_error)
    assert keras_internals.wrapped_function(metric) is keras.losses.mean_absolute_error
    assert keras_internals.wrapped_function(keras.metrics.AUC()) is None
    assert keras_internals.wrapped_kwargs(keras.metrics.AUC()) == {}


def test_before_compile_the_accessors_return_keras_own_none():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    assert keras_internals.compile_loss(model) is None
    assert keras_internals.compiled_metric_arguments(model) == (None, None)
    assert keras_internals.loss_tracker(model) is None


def test_a_writer_refuses_a_name_keras_no_longer_has():
    class Renamed:
        pass

    with pytest.raises(keras_internals.KerasInternalsError, match="`_initial_epoch` of .*Renamed"):
        keras_internals.set_initial_epoch(Renamed(), 3)
    assert not hasattr(Renamed, "_initial_epoch")


def test_check_model_names_a_missing_instance_attribute(monkeypatch):
    monkeypatch.setattr(keras_internals, "_CHECKED_CLASSES", set())
    keras_internals.check_model(_compiled_model())
    keras_internals.check_model(None)  # A callback list without a model: check() only.
    for holder in ("MODEL_ATTRIBUTES", "OPTIMIZER_ATTRIBUTES", "VARIABLE_ATTRIBUTES"):
        with monkeypatch.context() as patch:
            patch.setattr(keras_internals, "_CHECKED_CLASSES", set())
            attributes = {**getattr(keras_internals, holder), "_renamed_in_keras_9": "testing"}
            patch.setattr(keras_internals, holder, attributes)
            with pytest.raises(keras_internals.KerasInternalsError) as caught:
                keras_internals.check_model(_compiled_model())
        assert "`_renamed_in_keras_9`" in str(caught.value)
        assert f"Keras {keras.__version__} does not have" in str(caught.value)
