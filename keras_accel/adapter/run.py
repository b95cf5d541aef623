"""The last stage of `fit`, `evaluate` and `predict`: a call's checked batches wrapped as the
model's steps take them (a group of steps per host call where the backend reads them at
once), and Keras's own `fit`/`evaluate`/`predict` run on them inside a `Session` (the step
functions installed for the call, undone after it), with the measured choice of the step's
way (`keras_accel.adapter.choice`), host-loop fusion (`keras_accel.adapter.fusion`), the
call's callbacks and a schedule given the fit's length. Everything it sets lasts the call."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import keras
import numpy as np

from keras_accel.adapter import callback_list, choice, fusion, inputs
from keras_accel.adapter.guard import RecompileGuard
from keras_accel.adapter.pipeline import is_pipeline, preprocessor
from keras_accel.adapter.protocol import run_context
from keras_accel.adapter.session import FunctionCache, Session
from keras_accel.adapter.steps import StepContract
from keras_accel.data import start
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer


class Runner:
    """Runs Keras's own calls on a backend `runtime` inside `scope()` (the Accelerator's),
    with the recompile `guard` and the step functions kept between calls (`functions`)."""

    def __init__(
        self,
        runtime,
        guard: RecompileGuard,
        functions: FunctionCache,
        scope: Callable[[], contextlib.AbstractContextManager],
        sync_batchnorm: bool,
    ):
        self.runtime = runtime
        self.guard = guard
        self.functions = functions
        self.scope = scope
        self.sync_batchnorm = sync_batchnorm

    def fit(
        self,
        model,
        train,
        val,
        contracts: dict[str, StepContract],
        n: int,
        jit_compile,
        callbacks,
        verbose,
        epochs: int,
        initial_epoch: int,
        steps_per_epoch: int | None,
        validation_steps: int | None,
        validation_freq,
    ):
        """Keras's `fit` of `model` on the `train` batches (and `val`), `n` steps per call."""
        steps = steps_per_epoch or train.plan.num_batches
        # The call's steps where its epochs are whole passes of known length: what a
        # compiled way would save (`choice`).
        known = steps if steps_per_epoch is None and steps else None
        epochs_left = int(epochs) - int(initial_epoch)
        call_steps = {
            "train": None if known is None else epochs_left * int(known),
            "test": _validation_steps(val, validation_steps, epochs_left, validation_freq),
        }
        preprocess = preprocessor(model)
        with choice.in_call(model, call_steps, printing(verbose), jit_compile):
            train_data = self.feed(model, "train", train, n, preprocess, steps_per_epoch)
            # A Grain data set's epochs end where a pass ends (keras_accel.data.grain).
            sync = EpochSync(
                self.guard,
                train,
                keras_ends_epochs=isinstance(train_data, keras.utils.PyDataset)
                or getattr(train_data, "keras_accel_ends_epochs", False),
            )

            def patch(patches):
                bind_schedule(model, epochs, steps, patches, train.plan)
                fusion.install(
                    patches, model, n, callbacks, kind="train", epochs=int(epochs), steps=steps
                )
                if steps_per_epoch is None:  # Epochs of whole passes: one may begin late.
                    # TensorFlow reads a step's batch inside the step's graph, whose other
                    # ops may run before the data's end is found (the optimizer counted one
                    # more step, measured): Keras's loop is stopped at the late epoch's
                    # last batch. JAX's and torch's steps read theirs in Python first.
                    stops = keras.backend.backend() == "tensorflow"
                    run_context(model).can_begin_late(
                        patches, functools.partial(begin_late, train_data, n, stops), stops
                    )

            with (
                self.scope(),
                self.session(model, contracts, train_data, train, contracts["train"], patch),
            ):
                return keras_method(model, "fit")(
                    train_data,
                    epochs=epochs,
                    verbose=verbose,
                    # Rows are shuffled per epoch by our batches; Keras must keep their order.
                    shuffle=False,
                    callbacks=callback_list.for_call(
                        model,
                        fusion.progress(
                            [sync, *(callbacks or []), *self.runtime.callbacks()], verbose
                        ),
                        train_data,
                        verbose=verbose,
                        epochs=epochs,
                        steps=steps_per_epoch,
                        history=True,
                    ),
                    validation_data=None
                    if val is None
                    else self.feed(model, "test", val, n, preprocess, validation_steps),
                    initial_epoch=initial_epoch,
                    steps_per_epoch=steps_per_epoch,
                    validation_steps=validation_steps,
                    validation_freq=validation_freq,
                )

    def evaluate(
        self,
        model,
        batches,
        contract: StepContract,
        n: int,
        jit_compile,
        callbacks,
        verbose,
        steps: int | None,
        return_dict: bool,
    ):
        """Keras's `evaluate` of `model` on `batches`, `n` steps per call."""
        length = steps or batches.plan.num_batches
        patch = functools.partial(
            fusion.install, model=model, n=n, callbacks=callbacks, kind="test", steps=length
        )
        with choice.in_call(
            model, {"test": None if steps else length}, printing(verbose), jit_compile
        ):
            data = self.feed(model, "test", batches, n, preprocessor(model), steps)
            with (
                self.scope(),
                self.session(model, {"test": contract}, data, batches, contract, patch),
            ):
                result = keras_method(model, "evaluate")(
                    data,
                    verbose=verbose,
                    steps=steps,
                    callbacks=self.call_callbacks(model, callbacks, data, verbose, steps),
                    return_dict=return_dict,
                )
        self.guard.mark_warm(model, "test")
        return result

    def predict(self, model, batches, n: int, callbacks, verbose, steps: int | None):
        """Keras's `predict` of `model` on `batches`, `n` steps per call: the outputs of the
        real rows only, in order (each batch's row mask comes back beside its outputs)."""
        data = self.runtime.wrap(batches, True, preprocessor(model))
        contracts = {"predict": StepContract(pass_weights=False)}
        length = steps or batches.plan.num_batches
        patch = functools.partial(
            fusion.install, model=model, n=n, callbacks=callbacks, kind="predict", steps=length
        )
        # The model's step sees `(x,)`, as Keras's own: nothing to build it from for us.
        with self.scope(), self.session(model, contracts, data, batches, None, patch):
            outputs, row_mask = keras_method(model, "predict")(
                data,
                verbose=verbose,
                steps=steps,
                callbacks=self.call_callbacks(model, callbacks, data, verbose, steps),
            )
        self.guard.mark_warm(model, "predict")
        keep = np.asarray(row_mask).reshape(-1) > 0
        return keras.tree.map_structure(lambda a: np.asarray(a)[keep], outputs)

    def feed(self, model, kind: str, batches, n: int, preprocess, steps):
        """`batches` as the model's `kind` steps take them: one group of `n` batches per call
        where the backend reads a call's steps at once (`Runtime.grouped`) and the call's
        epochs are whole passes (`steps` None), else batch by batch (`Runtime.wrap`)."""
        if steps is None:
            grouped = self.runtime.grouped(batches, model, kind, n, preprocess)
            if grouped is not None:
                return grouped
        return self.runtime.wrap(batches, True, preprocess)

    def session(self, model, contracts, data, batches, first_contract, patch=None) -> Session:
        """The call's `Session`: its step functions installed on `model`, built (where
        something is unbuilt) from the first batch of `data` as the step sees it."""
        first = (
            None
            if first_contract is None
            else functools.partial(inputs.first_batch, data, batches, first_contract, model)
        )
        return Session(
            model,
            contracts,
            self.runtime,
            self.guard.record,
            self.functions,
            first_batch=first,
            patch=patch,
            sync_batchnorm=self.sync_batchnorm,
        )

    def call_callbacks(self, model, callbacks, data, verbose, steps):
        """The callbacks Keras's `evaluate` or `predict` gets: the user's and the runtime's,
        our progress bar where Keras would add its own, in our CallbackList where `data` is
        one of our adapters (`callback_list.for_call`)."""
        callbacks = fusion.progress(self._with_own(callbacks), verbose)
        return callback_list.for_call(model, callbacks, data, verbose=verbose, steps=steps)

    def _with_own(self, callbacks):
        """The user's callbacks and the runtime's; the user's own object where none."""
        own = self.runtime.callbacks()
        if not own:
            return callbacks
        if isinstance(callbacks, keras.callbacks.CallbackList):
            raise TypeError(
                "Pass callbacks as a list: a keras.callbacks.CallbackList cannot take the "
                "callback that keeps batch ends on the main thread across processes. "
                f"Received: callbacks={callbacks!r}"
            )
        return [*(callbacks or []), *own]


def begin_late(train_data, n: int, stops: bool, epoch: int, batch: int) -> bool:
    """Have `train_data` begin `epoch` at `batch` (a resume, `keras_accel.data.start`)
    where `batch` ends a host call of `n` steps (each call's group as in the uninterrupted
    run). Not a `PyDataset` that Keras reads through its own adapter where the late epoch's
    loop is stopped (`stops`: TensorFlow on one device): stopped before the data's end, that
    adapter's epoch stays open and the next one refuses to begin (Keras's "`on_epoch_begin`
    was called twice"); its first batches are replayed instead."""
    if stops and isinstance(train_data, keras.utils.PyDataset):
        return False
    return batch % n == 0 and start.start_at(train_data, epoch, batch)


def keras_method(model, name: str):
    """The Keras method to call: the model's own, except for a keras-hub pipeline model,
    whose fit/evaluate/predict would preprocess our batches a second time: we preprocess
    (see `keras_accel.adapter.pipeline`) and call Keras's."""
    if is_pipeline(model):
        return functools.partial(getattr(keras.Model, name), model)
    return getattr(model, name)


def printing(verbose) -> bool:
    """Whether a call's one-line notes print (Keras's "auto" prints)."""
    return bool(1 if verbose == "auto" else verbose)


def _validation_steps(val, validation_steps, epochs: int, validation_freq) -> int | None:
    """The validation steps a `fit` of `epochs` epochs runs (None: unknown or none)."""
    per_pass = None if val is None else validation_steps or val.plan.num_batches
    if not per_pass or not isinstance(validation_freq, int) or validation_freq < 1:
        return None
    return (epochs // validation_freq) * int(per_pass)


def bind_schedule(model, epochs: int, steps_per_epoch: int | None, patches, plan) -> None:
    """A keras_accel schedule given to the optimizer without the training length
    (`WarmupCosine(warmup_fraction=...)`) gets this fit's, for this fit."""
    optimizer = getattr(model, "optimizer", None)
    inner = inner_optimizer(optimizer)
    schedule = None if inner is None else keras_internals.learning_rate_of(inner)
    if getattr(schedule, "needs_total_steps", False):
        if steps_per_epoch is None:
            raise ValueError(
                f"The optimizer's learning-rate schedule {type(schedule).__name__} is given "
                f"as a fraction of training, which needs the number of steps, but fit got "
                f"{plan.describe()}, whose length is unknown. Pass steps_per_epoch to fit, "
                "or give the schedule its total steps."
            )
        bound = schedule.with_total_steps(
            int(epochs) * steps_per_epoch, steps_per_epoch=steps_per_epoch
        )
        keras_internals.patch_learning_rate_of(patches, inner, bound)


class EpochSync(keras.callbacks.Callback):
    """Keeps the training batches on Keras's epoch index (so the shuffle order of epoch k is
    the same in a resumed run), and ends the recompile guard's warm-up after the first epoch
    and its validation."""

    def __init__(self, guard: RecompileGuard, batches, keras_ends_epochs: bool):
        super().__init__()
        self.guard = guard
        self.batches = batches
        self.keras_ends_epochs = keras_ends_epochs

    def on_epoch_begin(self, epoch, logs=None):
        if hasattr(self.batches, "epoch"):
            self.batches.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        # Keras calls a PyDataset's on_epoch_end itself; a tf.data pipeline needs us to.
        if not self.keras_ends_epochs and hasattr(self.batches, "on_epoch_end"):
            self.batches.on_epoch_end()
        self.guard.mark_warm(self.model, "train")
        if logs and any(key.startswith("val_") for key in logs):
            self.guard.mark_warm(self.model, "test")
