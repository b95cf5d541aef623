"""Host-loop fusion: how many steps one host call runs (Keras's `steps_per_execution`).

Each call from Keras's fit loop into the compiled step costs the same whatever the step
computes: Python in Keras's loop, every callback's batch hooks, and turning the logs into
numbers, which waits for the device. Running N steps per call divides that cost by N and
changes nothing else: the same compiled step runs N times (TensorFlow: in one `tf.function`
while-loop over the iterator; JAX: N dispatches of the same jitted step, with no host sync
between them), so weights, metrics and epoch logs are those of N=1. What changes is what
batch hooks see: they fire once per N steps. So "auto" fuses only when every callback can
take that:

- a callback that overrides a batch hook of this kind is taken to need every batch, and
  turns fusion off, with a one-line note naming it; Keras's progress bar, and Keras's
  checkpoint callbacks with `save_freq="epoch"` (whose batch hooks do nothing then), can;
- a callback that defines `fusion_period(kind, steps)` says what it can take (the public
  protocol, `keras_accel.adapter.protocol`; users' callbacks too): a per-step
  `LearningRateScheduler` moves its schedule into the step (the rate changes at every step
  inside a group), `BackupAndRestore(save_freq=N)` needs groups that end where it saves, a
  `History(per_step=True)` needs every step.

The rule for "auto": N = the largest divisor of every callback's period that is at most
`AUTO_LIMIT`, at most the steps of one epoch, and, for arrays, at most as many batches as
fit in `AUTO_BYTES`. Per-call overhead then falls to at most 1/32 of what it was, where it
stops mattering next to the step itself, while the progress bar and a KeyboardInterrupt
still act within 32 steps. The byte bound is for memory: a fused call holds its batches at
once (a JAX group stacked, a TensorFlow group of batches read from disk), so 32 batches of
16 MiB would hold 512 MiB whatever the data's size, where plain Keras holds one or a few
batches; and a step over a MiB of input is long enough that a call per few steps costs
little. A last group of fewer than N steps
runs the same compiled step (no new compilation). An explicit value wins: `compile(...,
steps_per_execution=N)` with N > 1, or `Accelerator(steps_per_execution=N)`.
"""

from __future__ import annotations

import math
import re
import weakref

import keras

from keras_accel.adapter import protocol
from keras_accel.data.batching import UNPADDED
from keras_accel.utils.printing import print_msg

AUTO = "auto"
AUTO_LIMIT = 32
# A fused group's batches at most (arrays: `ArrayBatches.batch_bytes`). A JAX group is held
# on the host and on the device, and the next one is read while it runs: about 4 times this
# (measured, a memory map of 4 KiB rows at batch 4,096: a group of 4 batches, 64 MiB, took
# 325 MB above the process's baseline, one batch per call 89 MB, plain Keras 101 MB).
AUTO_BYTES = 16 * 2**20

_HOOKS = {
    "train": ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end"),
    "test": ("on_test_batch_begin", "on_test_batch_end"),
    "predict": ("on_predict_batch_begin", "on_predict_batch_end"),
}
# Models already told about their fusion, per reason (`note`): each note is printed once.
_NOTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# id(model) -> the model's own steps_per_execution, while a call has set ours on it (a call
# made inside another's callback must see the user's value, not the outer call's).
_USERS: dict[int, int] = {}


def check(value):
    """`steps_per_execution` as the Accelerator takes it: "auto" or a positive int."""
    if value == AUTO:
        return value
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            "`steps_per_execution` must be 'auto' or a positive integer (1 turns fusion "
            f"off). Received: steps_per_execution={value!r}"
        )
    return value


def batch_hooks(callback, kind: str) -> list[str]:
    """The batch hooks of `kind` that `callback` defines (as a method or an attribute)."""
    found = []
    for name in _HOOKS[kind]:
        method = getattr(callback, name, None)
        if getattr(method, "__func__", method) is not getattr(keras.callbacks.Callback, name):
            found.append(name)
    return found


def _keras_takes_fusion(callback) -> bool:
    # Keras's own, whose batch hooks only display, or do nothing at save_freq="epoch".
    if isinstance(callback, keras.callbacks.ProgbarLogger):
        return True
    checkpoints = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)
    return isinstance(callback, checkpoints) and getattr(callback, "save_freq", None) == "epoch"


def choose(
    requested,
    model,
    kind: str,
    steps: int | None,
    callbacks,
    validating: bool = False,
    fuse_predictions: bool = False,
    batch_bytes: int | None = None,
) -> tuple[int, str]:
    """`(N, why)`: the steps per host call for one fit/evaluate/predict of `model`.

    Args:
        requested: the Accelerator's `steps_per_execution` ("auto" or an int).
        kind: "train", "test" or "predict".
        steps: steps in one epoch (or in the evaluation), if known.
        callbacks: the user's callbacks for this call.
        validating: a fit with validation data, whose callbacks' test batch hooks run too
            (at the same N: Keras validates with the fit's `steps_per_execution`).
        fuse_predictions: the backend runs a group of predictions in one program of one
            shape (JAX's `GroupedSteps`), so "auto" fuses `predict` too.
        batch_bytes: bytes of one batch where known (arrays): "auto" holds at most
            `AUTO_BYTES` of batches in one call.
    """
    compiled = _USERS.get(id(model), getattr(model, "steps_per_execution", 1))
    compiled = int(compiled or 1)
    if compiled > 1:
        return compiled, f"compile(steps_per_execution={compiled})"
    if requested != AUTO:
        return requested, f"Accelerator(steps_per_execution={requested})"
    if kind == "predict" and not fuse_predictions:
        # Keras's fused predict concatenates the group's outputs in a program whose shape
        # changes with the last group; JAX's scan returns every group in one shape.
        return 1, "auto: prediction runs one batch per host call"
    limit = max(1, min(AUTO_LIMIT, steps or AUTO_LIMIT))
    by_bytes = AUTO_BYTES // batch_bytes if batch_bytes else AUTO_LIMIT
    if by_bytes < limit:
        limit = max(1, by_bytes)
        bounded_by = [(f"batches of {_size(batch_bytes)}", 0, [])]
    else:
        bounded_by = []
    period = 0  # gcd(0, p) = p: no constraint yet.
    kinds = (kind, "test") if validating and kind == "train" else (kind,)
    for callback in callbacks or []:
        for each in kinds:
            own = getattr(callback, "fusion_period", None)
            hooks = batch_hooks(callback, each)
            if own is not None:
                p = own(each, steps)
            elif not hooks or _keras_takes_fusion(callback):
                p = None
            else:
                p = 1
            if p is not None:
                period = math.gcd(period, int(p))
                bounded_by.append((type(callback).__name__, p, hooks))
    if period:
        limit = max(n for n in range(1, min(limit, period) + 1) if period % n == 0)
    why = f"auto: {limit} step(s) per host call"
    if bounded_by and limit < AUTO_LIMIT:
        why += ", bounded by " + ", ".join(_limit(*bound) for bound in bounded_by)
    return limit, why


def steps_per_call(
    requested,
    runtime,
    model,
    kind: str,
    steps: int | None,
    callbacks,
    verbose,
    validating: bool = False,
    divides: int | None = None,
    batches=None,
    validation=None,
) -> int:
    """N, the steps per host call of one call of `model` (`choose`), within what the
    backend's trainer runs per call (`runtime.max_steps_per_execution`) and dividing fit's
    `validation_steps` (`divides`); said once where the call prints (`note`). One where
    `batches` or fit's `validation` batches end in a batch that runs unpadded, of another
    shape than the others (`BatchPlan.remainder_rows`): a group's batches share one."""
    unpadded = [why for why in map(_unpadded, (batches, validation)) if why is not None]
    if unpadded:
        note(model, 1, unpadded[0], 1 if verbose == "auto" else verbose)
        return 1
    n, why = choose(
        requested,
        model,
        kind,
        steps,
        callbacks,
        validating=validating,
        fuse_predictions=runtime.fuses_predictions(model),
        batch_bytes=getattr(batches, "batch_bytes", None),
    )
    chosen = why.startswith(("compile(", "Accelerator("))
    limit = runtime.max_steps_per_execution
    backend = keras.backend.backend()
    if limit is not None and n > limit:
        if why.startswith("Accelerator("):
            raise ValueError(
                f"Keras's {backend} trainer runs at most {limit} step per call. "
                f"Received: Accelerator(steps_per_execution={n}). Use "
                "steps_per_execution='auto' (or 1) on this backend."
            )
        if not chosen:  # compile()'s own value: Keras says what it takes.
            n, why = limit, f"auto: Keras's {backend} trainer runs one step per call"
    if divides and not chosen and n > 1 and divides % n:
        # Keras validates with fit's steps_per_execution: a group of N steps must not
        # read past `validation_steps`.
        n = math.gcd(n, int(divides))
        why = f"{why}; dividing validation_steps={divides}"
    note(model, n, why, 1 if verbose == "auto" else verbose)
    return n


def _unpadded(batches) -> str | None:
    """Why `batches` run one step per call (a batch of another shape than the others, which
    a group cannot stack: an array's last partial batch, a stream's batch that is not full,
    run unpadded or marked to be cut), or None."""
    plan = getattr(batches, "plan", None)
    rows = getattr(plan, "remainder_rows", None)
    if rows is not None:
        return f"its last partial batch ({rows} rows) runs unpadded, as a step of its own shape"
    if plan is not None and plan.num_samples is None and plan.remainder in UNPADDED:
        return "a batch of its stream that is not full runs unpadded, as a step of its own shape"
    return None


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.3g} {unit}"
    return f"{count} bytes"


def _limit(name: str, period: int, hooks: list[str]) -> str:
    if period == 0:  # The byte bound.
        return f"{name}, at most {_size(AUTO_BYTES)} of them per call"
    if period == 1:
        return f"{name}, which needs every batch ({'/'.join(hooks) or 'its records'})"
    return f"{name}, which needs groups dividing {period} steps"


def note(model, n: int, why: str, verbose) -> None:
    """Say once per model and reason what fusion does (only where the call prints anything).

    The reason is `why` without its numbers: they follow each call's step count (a fit of
    15 steps per epoch fuses 15, its evaluate of 16 steps 16, a fit on more rows 32), and a
    note repeated for each would be printed at nearly every `fit` and `evaluate`. What the
    user can act on (fusion on, or off because of which callback) is said once.
    """
    if not verbose or n == 1 and "bounded" not in why:
        return
    reason = re.sub(r"\d+", "N", why)
    seen = _NOTED.setdefault(model, set())
    if reason in seen:
        return
    seen.add(reason)
    if n > 1:
        print_msg(
            f"keras_accel: steps_per_execution={n} ({why}); batch callbacks fire every {n} "
            "steps. Accelerator(steps_per_execution=1) turns fusion off."
        )
    else:
        print_msg(f"keras_accel: no host-loop fusion ({why}).")


def install(
    patches, model, n: int, callbacks, kind: str = "train", epochs=None, steps=None
) -> None:
    """For this call: N steps per host call, the model's `RunContext` holding the call's
    facts, and every callback that defines `set_run_context` given it."""
    if id(model) not in _USERS:
        patches.set_item(_USERS, id(model), getattr(model, "steps_per_execution", 1))
    patches.set(model, "steps_per_execution", n)
    if n > 1 and keras.backend.backend() == "torch":
        from keras_accel.adapter.backends import torch as torch_backend

        torch_backend.quiet_short_groups(patches)
    context = protocol.begin_call(patches, model, kind, epochs=epochs, steps=steps)
    for callback in callbacks or []:
        hook = getattr(callback, "set_run_context", None)
        if hook is not None:
            hook(context)


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras's progress bar, counting steps only up to the real end of an epoch.

    Keras reports a group of N fused steps as ending N - 1 steps after its first, also for
    a last group that holds fewer (a 79-step epoch in groups of 32 ends at "96/79"). This
    bar shows such a group as ending at the last step (79/79), and is Keras's own
    otherwise. The Accelerator gives it in place of the one Keras would add (`progress`);
    its batch ends may run in Keras's callback thread, as those of Keras's own bar do.
    """

    async_safe = True

    def _last(self, batch: int) -> int:
        target = self.target
        return batch if target is None else min(batch, int(target) - 1)

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(self._last(batch), logs)

    def on_test_batch_end(self, batch, logs=None):
        super().on_test_batch_end(self._last(batch), logs)

    def on_predict_batch_end(self, batch, logs=None):
        super().on_predict_batch_end(self._last(batch), logs)


def progress(callbacks, verbose):
    """The callbacks for Keras's call, with a `ProgressBar` where Keras would add its own
    (verbose on, and no `ProgbarLogger` among them); a `CallbackList` is the user's whole
    choice and passes as it is."""
    if isinstance(callbacks, keras.callbacks.CallbackList) or not verbose:
        return callbacks
    callbacks = list(callbacks or [])
    if any(isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks):
        return callbacks
    return [*callbacks, ProgressBar()]
