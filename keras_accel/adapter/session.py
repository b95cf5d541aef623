"""One Accelerator call on one model: what it installs, and how all of it goes away again.

For the duration of `acc.fit`, `acc.evaluate` or `acc.predict` the model's steps are wrapped
(`keras_accel.adapter.steps`), its compiled metrics and loss trackers see the row mask, its
BatchNormalization layers compute masked, synchronized moments (`keras_accel.adapter.
batchnorm`), and on TensorFlow the backend makes losses global-batch losses. Keras's compiled
step functions close over all of that, so they belong to the call too: the session swaps in
the functions an earlier call with the same contract compiled (no recompilation from one
`acc.fit` to the next) and, on the way out, keeps ours aside and gives the model back its own.
After the call the model, its layers and Keras behave exactly as if keras_accel had never
touched them.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable

import keras

from keras_accel.adapter.batchnorm import install_batchnorm
from keras_accel.adapter.loss_weights import install_loss_masks, install_loss_values
from keras_accel.adapter.patches import Patches
from keras_accel.adapter.steps import (
    STEP_KINDS,
    StepContract,
    install_loss_trackers,
    install_metric_masks,
    install_own_metrics,
    install_steps,
)
from keras_accel.utils import keras_internals
from keras_accel.utils.optimizers import inner_optimizer

# Models inside an Accelerator call now: a call made from within another one on the same
# model (a callback that runs acc.evaluate) reuses its installation.
_ACTIVE: dict[int, Session] = {}


def in_call() -> bool:
    """Whether an Accelerator call (`fit`, `evaluate`, `predict`) is in progress in this
    process."""
    return bool(_ACTIVE)


class FunctionCache:
    """The step functions Keras compiled during our calls, per model, kept out of the model:
    those of the `MODELS` models used most recently.

    A compiled step closes over its model (Keras's `train_function` reads `self`), so a
    function kept here keeps its model alive, with its weights and its traced graphs: kept
    for every model an Accelerator ever ran, a notebook or a hyperparameter search that
    makes a new model each time would never get that memory back. Kept for the last few
    only, a model the user dropped is freed once `MODELS` others have run, while repeated
    calls on one model, or on two in turn (a GAN's, a teacher and its student), reuse their
    functions."""

    MODELS = 2

    def __init__(self):
        # id(model) -> (a weak reference to it, its functions by key), least recent first. The
        # weak reference tells a model from a new one that got a dead one's id.
        self._by_model: collections.OrderedDict[int, tuple[weakref.ref, dict]] = (
            collections.OrderedDict()
        )

    def key(self, model, kind: str, contract: StepContract, runtime=None) -> tuple:
        # Everything a compiled step closes over that a user can change between calls.
        n = getattr(model, "steps_per_execution", 1)
        if runtime is not None and runtime.reads_steps_per_execution(model, kind):
            n = "read at each call"  # One function serves every N it runs.
        return (
            kind,
            contract,
            getattr(model, "optimizer", None),
            keras_internals.compile_loss(model),
            keras_internals.compile_metrics(model),
            n,
            _rate_key(getattr(model, "optimizer", None)),
            getattr(model, "jit_compile", None),
            getattr(model, "run_eagerly", False),
        )

    def get(self, model, key: tuple):
        return self._functions(model).get(key)

    def put(self, model, key: tuple, function) -> None:
        if function is not None:
            self._functions(model)[key] = function

    def _functions(self, model) -> dict:
        """`model`'s functions, now the most recently used; the least recent model's dropped
        beyond `MODELS`."""
        entry = self._by_model.pop(id(model), None)
        if entry is None or entry[0]() is not model:
            entry = (weakref.ref(model), {})
        self._by_model[id(model)] = entry
        while len(self._by_model) > self.MODELS:
            self._by_model.popitem(last=False)
        return entry[1]


def _rate_key(optimizer):
    """What the optimizer's learning rate is, as a compiled step reads it: the step closes
    over a schedule object (ours may swap one in for a call), or reads a variable, which is
    part of the optimizer's state (LearningRateScheduler may have added one)."""
    rate = (
        None if optimizer is None else keras_internals.learning_rate_of(inner_optimizer(optimizer))
    )
    if rate is None or isinstance(rate, keras.Variable):
        return id(rate)
    try:  # Two schedules of one class and config compute the same rates.
        return (type(rate), repr(rate.get_config()))
    except Exception:  # A schedule without a config: only itself is known to be equal.
        return (type(rate), id(rate))


class Session:
    """A context manager: install on enter, restore on exit (see the module docstring).

    Args:
        model: the user's model.
        contracts: the step contract per kind for this call.
        runtime: the backend runtime (`all_reduce_sum`, `row_count`, `install`).
        record: `record(model, kind, data)`, the recompile guard.
        functions: where compiled step functions are kept between calls.
        first_batch: returns the first batch as the model's step would see it, for Keras's
            symbolic build (called at most once, only if something is unbuilt).
        patch: extra installs, `patch(patches)`, undone with the rest.
    """

    def __init__(
        self,
        model,
        contracts: dict[str, StepContract],
        runtime,
        record: Callable,
        functions: FunctionCache,
        first_batch: Callable,
        patch: Callable | None = None,
        sync_batchnorm: bool = True,
    ):
        self.model = model
        self.contracts = dict(contracts)
        self.runtime = runtime
        self.record = record
        self.functions = functions
        self.first_batch = first_batch
        self.patch = patch
        self.sync_batchnorm = sync_batchnorm
        self.patches = Patches()
        self._keys: dict[str, tuple] = {}
        self._outer: Session | None = None

    def __enter__(self) -> Session:
        keras_internals.check()
        model, patches = self.model, self.patches
        outer = _ACTIVE.get(id(model))
        try:
            if outer is not None:
                # Nested call: our wrappers are in place already; swap the contracts of the
                # kinds this call runs, and their compiled functions, for its duration.
                self._outer = outer
                for kind, contract in self.contracts.items():
                    patches.set_item(outer.contracts, kind, contract)
                if self.patch is not None:
                    self.patch(patches)
            else:
                _ACTIVE[id(model)] = self
                self._install()
            for kind in STEP_KINDS:
                contract = self._contract(kind)
                self._keys[kind] = key = self.functions.key(model, kind, contract, self.runtime)
                function = self.functions.get(model, key)
                if function is None:
                    function = self._make_function(kind)
                patches.set(model, f"{kind}_function", function)
        except BaseException:
            self._leave()
            raise
        return self

    def _make_function(self, kind: str):
        if self._contract(kind).replicated:
            function = self.runtime.replicated_function(self.model, kind)
            if function is not None:
                return function
        return self.runtime.make_function(self.model, kind)

    def _contract(self, kind: str) -> StepContract:
        contracts = self._outer.contracts if self._outer is not None else self.contracts
        return contracts.get(kind) or StepContract(pass_weights=False)

    def _install(self) -> None:
        model, patches, runtime = self.model, self.patches, self.runtime
        batch = None if self.first_batch is None else _Once(self.first_batch)
        runtime.install(patches, model, batch, training="train" in self.contracts)
        install_steps(
            patches,
            model,
            self.contracts,
            lambda kind, data: self.record(model, kind, data),
            runtime.row_count,
        )
        runtime.install_outer(patches, model)  # What must wrap our step wrappers.
        install_metric_masks(patches, model)
        install_loss_values(patches, model, runtime.summed_loss_factor)
        install_loss_masks(patches, model, runtime.row_count)
        install_own_metrics(patches, model)
        if keras_internals.loss_tracker(model) is not None:
            install_loss_trackers(patches, model)
        install_batchnorm(patches, model, runtime.all_reduce_sum, self.sync_batchnorm)
        if self.patch is not None:
            self.patch(patches)

    def __exit__(self, *exc_info) -> bool:
        for kind, key in self._keys.items():
            self.functions.put(self.model, key, getattr(self.model, f"{kind}_function", None))
        self._leave()
        return False

    def _leave(self) -> None:
        self.patches.restore()
        if self._outer is None and _ACTIVE.get(id(self.model)) is self:
            del _ACTIVE[id(self.model)]


class _Once:
    """Calls `fn` the first time it is called; returns that result ever after."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self._done = False
        self._value = None

    def __call__(self):
        if not self._done:
            self._value, self._done = self.fn(), True
        return self._value
