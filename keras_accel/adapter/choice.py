"""Compiled or not: which way a model's steps run, chosen by timing both on the model itself.

Two ways run the same step with the same numbers, up to float rounding, and which is faster
depends on the model and the machine, not on a rule: on one TensorFlow device a group of
steps runs as one XLA program or as TensorFlow's graph step (Keras's "auto" leaves XLA off
on every CPU); on torch, Keras's step runs compiled as one program
(`keras_accel.adapter.backends.torch.compiled`) or eagerly, as Keras's torch trainer runs
it. Measured on a 2-core CPU: XLA ran a small Embedding + LayerNormalization text classifier
5 times as fast as the graph step, and the seed CNN's convolutions 74 times as slowly. So,
like cuDNN's benchmark mode for kernels, the Accelerator times both on the user's model:

1. The steps run the plain way first, each host call timed (the first, which traces, is
   not). A host call is a "unit": a group of steps on TensorFlow, one step on torch.
2. Once the plain way's time for this model and step kind (spent so far in the process,
   plus what the current call's remaining steps would take) reaches the trial threshold
   (`TRIAL_AFTER_S`, per backend about one compilation's cost: a compilation that saves
   less than that cannot pay for itself; where the compiled way can save only a known
   amount a step, `most_saved_s`, steps too long for that to matter are not tried), a
   trial: the compiled way's first unit (its compilation, timed apart), then units of each
   way in turn until each has its share of timed units. Every unit of the trial trains:
   nothing is run twice. Where a plain step is slow, the compiled way's first units run one
   step each, and a compiled way more than `SLOWER` times as slow is given up after one
   timed step (bounding what the trial costs where compiling is a bad idea).
3. The way with the lower median time per step is kept (the compiled way only where it is
   faster by `MARGIN`), and one line says which, with both times and the compilation's.

A decision is kept per model, kind and input signature for the process, and under a
fingerprint of the model, its compile arguments, the input signature, the machine and the
library versions in this process and on disk (`keras_accel.adapter.choice_cache`), so that
the next run, or a tuner's next trial of the same architecture, starts on the faster way.

What forces a way instead, first match wins: `run_eagerly=True` (eager, as in Keras);
`Accelerator(jit_compile=True | False)`; `KERAS_ACCEL_JIT_COMPILE=1 | 0` (`auto`, the
default, measures); on torch, the model's own `compile(jit_compile=True)` (on TensorFlow
and JAX the plain way runs the step as the model compiles it, so the model's setting
forces nothing: `model_decides`). A model compiled with `jit_compile=False` is measured
like one compiled with Keras's default "auto": Keras resolves "auto" to False on CPUs and
on torch, and records both alike.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable

from keras_accel.adapter import choice_cache

AUTO = "auto"
PLAIN, COMPILED = "plain", "compiled"
ENVIRONMENT = "KERAS_ACCEL_JIT_COMPILE"
# Seconds of plain steps (spent in the process plus the call's projected rest) from which a
# trial is run; per backend, about what one compilation of a small model costs on a CPU
# (TensorFlow's XLA: ~1 s; torch.compile: several seconds; JAX's scan: the step compiled
# once more, under a second). `KERAS_ACCEL_JIT_COMPILE_AFTER` sets it for every backend.
TRIAL_AFTER_S = {"tensorflow": 1.0, "torch": 4.0, "jax": 0.5}
# Timed units of each way in a trial (after the compiled way's first): groups of steps on
# TensorFlow, single steps on torch, whose times vary more.
TRIAL_UNITS = {"tensorflow": 3, "torch": 12, "jax": 3}
# The compiled way is kept where its median step is at most (1 - MARGIN) of the plain one's:
# a tie keeps the way that needs no compiler.
MARGIN = 0.05
# A plain step this long (seconds) or longer: the compiled way's first units run one step
# each, so that a compiled way much slower than it costs one step to find out.
ONE_STEP_UNITS_FROM_S = 0.005
# A compiled step over this many times the plain one ends the trial at once.
SLOWER = 2.0
# A trial also needs this many plain steps' time at stake (spent, plus the call's projected
# rest): its worst case, a compiled way about 100 times as slow for the one or two steps
# that tell (XLA:CPU's convolution gradients inside a loop), must be small against it.
TRIAL_RISK_STEPS = 200
# Over several processes every process must take the same way at the same step (their
# steps hold collectives): decisions are made on values agreed at every this-many units.
AGREE_EVERY = 16


def requested(setting, model, model_decides: bool = True) -> tuple[str, str]:
    """The way `model`'s steps must run, and what says so: `(COMPILED | PLAIN | AUTO,
    why)`. `setting` is the Accelerator's `jit_compile` argument; `model_decides`: whether
    the model's own `jit_compile=True` forces the compiled way (not on JAX, where Keras's
    "auto" resolves to True and both ways are compiled)."""
    if getattr(model, "run_eagerly", False):
        return PLAIN, "run_eagerly=True"
    if setting is not AUTO:
        return (COMPILED if setting else PLAIN), f"Accelerator(jit_compile={setting})"
    env = environment_setting()
    if env is not AUTO:
        return (COMPILED if env else PLAIN), f"{ENVIRONMENT}={os.environ[ENVIRONMENT]}"
    if model_decides and getattr(model, "jit_compile", False) is True:
        return COMPILED, "the model's jit_compile=True"
    # False: Keras's "auto" (which it resolves to False on CPUs and on torch) or the user's
    # False, which Keras records alike: ours to measure.
    return AUTO, "measured"


def check_setting(setting):
    """The Accelerator's `jit_compile` argument, checked."""
    if setting is AUTO or setting == AUTO:
        return AUTO
    if isinstance(setting, bool):
        return setting
    raise ValueError(
        "`jit_compile` must be 'auto' (measure the compiled and the plain step on the model "
        "and keep the faster), True (always compiled: XLA on TensorFlow, one program on "
        f"torch) or False (as Keras runs the step). Received: jit_compile={setting!r}"
    )


def environment_setting():
    """`KERAS_ACCEL_JIT_COMPILE` as AUTO, True or False; a value it cannot read is an error
    that names it."""
    raw = os.environ.get(ENVIRONMENT, AUTO).strip().lower()
    if raw in ("", AUTO):
        return AUTO
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(
        f"{ENVIRONMENT} must be 'auto', '1' (always compiled) or '0' (never). "
        f"Received: {ENVIRONMENT}={os.environ[ENVIRONMENT]!r}"
    )


def trial_after_s(backend: str) -> float:
    raw = os.environ.get("KERAS_ACCEL_JIT_COMPILE_AFTER")
    if raw is None:
        return TRIAL_AFTER_S[backend]
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise ValueError(
            "KERAS_ACCEL_JIT_COMPILE_AFTER must be a number of seconds >= 0. "
            f"Received: KERAS_ACCEL_JIT_COMPILE_AFTER={raw!r}"
        )
    return value


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which way a model's steps of one kind run, and on what grounds.

    Attributes:
        path: COMPILED or PLAIN.
        how: "measured", "remembered" (an earlier measurement of the same fingerprint),
            "forced" (see `requested`), or "failed" (the compiler refused the step).
        plain_step_s, compiled_step_s: the median seconds per step of each way in the trial.
        compile_s: what the compiled way's first unit took beyond its steps.
        why: for "forced" and "failed", what forced it or the compiler's error.
    """

    path: str
    how: str
    plain_step_s: float | None = None
    compiled_step_s: float | None = None
    compile_s: float | None = None
    why: str = ""


@dataclasses.dataclass
class Call:
    """What the Accelerator's current call says of one kind of steps: how many it will run
    (None: unknown), whether it prints, and what decides the way (`requested`)."""

    steps: int | None
    verbose: bool
    setting: object = AUTO
    done: int = 0

    def left(self) -> int:
        return 0 if self.steps is None else max(0, self.steps - self.done)


# The current call's `Call` per model and kind (`in_call`); set by the Accelerator.
_CALLS: dict[tuple[int, str], Call] = {}
_NO_CALL = Call(None, False)  # Steps run outside `in_call`: nothing known of the call.
_LOCK = threading.Lock()


class in_call:
    """Within: `model`'s steps of each kind in `steps` belong to a call that runs that many
    of them (None: unknown), with `verbose` and the Accelerator's `jit_compile` setting."""

    def __init__(self, model, steps: dict[str, int | None], verbose, setting=AUTO):
        self.keys = [(id(model), kind) for kind in steps]
        self.calls = {
            (id(model), kind): Call(count, bool(verbose), setting) for kind, count in steps.items()
        }
        self.saved: dict = {}

    def __enter__(self):
        with _LOCK:
            for key, call in self.calls.items():
                self.saved[key] = _CALLS.get(key)
                _CALLS[key] = call
        return self

    def __exit__(self, *exc_info):
        with _LOCK:
            for key, saved in self.saved.items():
                if saved is None:
                    _CALLS.pop(key, None)
                else:
                    _CALLS[key] = saved
        return False


def current_call(model, kind: str) -> Call:
    """The Accelerator call running `model`'s `kind` steps now (a default where none: a
    Keras call of ours outside `in_call`)."""
    call = _CALLS.get((id(model), kind))
    return call if call is not None else _NO_CALL


class Choice:
    """The way one model's steps of one kind with one input signature run, measured.

    A runner asks `unit(available)` before each host call, for the way to run it and how
    many of the `available` steps it runs, runs them, and tells `record(path, seconds,
    steps)` what they took (`timed()`: whether it must wait for the results to tell).

    Args:
        backend: "tensorflow" or "torch" (the trial's threshold and length).
        names: how the note names the two ways, `{PLAIN: ..., COMPILED: ...}`.
        model: the model (held weakly), for its name in the note and its current call.
        kind: "train" or "test".
        fingerprint: the key under which the decision is remembered (`choice_cache`), or
            None where the model has none (remembered for this model only); or a function
            that returns it, called where the decision is the measurement's.
        refuses: a function that returns why the compiled way cannot run the steps (None:
            it can), asked where the decision is the measurement's.
        most_saved_s: where the compiled way can save at most this many seconds a step (JAX's
            scanned group saves the host's per-call work, nothing of the step itself), a
            plain step long enough that it could not save `MARGIN` of it keeps the plain way
            without a trial.
        model_decides: whether the model's `jit_compile=True` forces the compiled way
            (`requested`).
        slow_units: where plain steps are slow, the steps of the compiled way's first unit
            (its compilation) and of its first timed one: (1, 2) where a program's first
            step runs apart from the rest (TensorFlow's group: the step in the loop is the
            one that tells).
        agree: over several processes, `agree(values) -> values` giving every process the
            elementwise maximum of a list of floats; None in one process.
        announce: `announce(message)` prints the decision's note.
    """

    def __init__(
        self,
        backend: str,
        names: dict[str, str],
        model,
        kind: str,
        fingerprint: str | Callable[[], str | None] | None = None,
        agree: Callable | None = None,
        announce: Callable[[str], None] | None = None,
        refuses: Callable[[], str | None] | None = None,
        most_saved_s: float | None = None,
        model_decides: bool = True,
        slow_units: tuple[int, int] = (1, 1),
    ):
        self.backend = backend
        self.names = names
        self.model_ref = weakref.ref(model)
        self.model_name = getattr(model, "name", "model")
        self.kind = kind
        self._fingerprint = fingerprint
        self.refuses = refuses
        self.most_saved_s = most_saved_s
        self.model_decides = model_decides
        self.slow_units = slow_units
        self.agree = agree
        self.announce = announce
        self.decision: Decision | None = None
        self.trial = False
        self._call: Call | None = None  # The call whose units run now.
        self._units = 0  # Units seen (the agreement points over processes).
        self._first = {PLAIN: True, COMPILED: True}  # The next unit of the way traces.
        self._plain: list[float] = []  # Seconds per step of timed plain units, before a trial.
        self._plain_spent = 0.0
        self._samples: dict[str, list[float]] = {PLAIN: [], COMPILED: []}  # In the trial.
        self._compile: tuple[float, int] | None = None  # The compiled first unit: (s, steps).

    @property
    def fingerprint(self) -> str | None:
        if callable(self._fingerprint):
            self._fingerprint = self._fingerprint()
        return self._fingerprint

    # ------------------------------------------------------------------ the runner's side

    def unit(self, available: int) -> tuple[str, int]:
        """`(way, steps)` for the next host call, of at most `available` steps."""
        call = current_call(self.model_ref(), self.kind)
        if call is not self._call:  # A new call: what forces a way may have changed.
            self._call = call
            self._at_call(call)
        if self.decision is not None:
            return self.decision.path, available
        if not self.trial:
            return PLAIN, available
        compiled, plain = self._samples[COMPILED], self._samples[PLAIN]
        path = COMPILED if self._first[COMPILED] or len(compiled) <= len(plain) else PLAIN
        if path == COMPILED and len(compiled) < 1 and self._plain_step() >= ONE_STEP_UNITS_FROM_S:
            # Its compilation on the fewest steps, then the fewest that tell its pace.
            first, timed = self.slow_units
            return COMPILED, min(available, first if self._first[COMPILED] else timed)
        return path, available

    def timed(self) -> bool:
        """Whether the runner must time its next unit (wait for its results)."""
        return self.decision is None

    def record(self, path: str, seconds: float, steps: int) -> None:
        """The unit just run took `seconds` for `steps` steps the `path` way."""
        if self.decision is not None or steps <= 0:
            return
        self._units += 1
        call = self._call if self._call is not None else _NO_CALL
        call.done += steps
        if self._first[path]:
            self._first[path] = False
            if path == COMPILED:
                self._compile = (seconds, steps)
        elif not self.trial:
            self._plain.append(seconds / steps)
            self._plain_spent += seconds
        else:
            self._samples[path].append(seconds / steps)
        if not self._at_agreement_point():
            return
        if not self.trial:
            if self._plain and self._nothing_to_gain():
                plain_s = self._plain_step()
                self._set(Decision(PLAIN, "measured", plain_s, why="nothing to gain"))
            elif self._plain and self._worth_a_trial(call):
                self.trial = True
            return
        self._maybe_decide()

    def failed(self, error: Exception) -> None:
        """The compiler refused the step: plain from now on, said once."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        self._set(Decision(PLAIN, "failed", why=f"{type(error).__name__}: {first}"[:300]))
        self.refuses = None

    # ------------------------------------------------------------------ the decisions

    def _at_call(self, call: Call) -> None:
        path, why = requested(call.setting, self.model_ref(), self.model_decides)
        if path is not AUTO:
            self.decision = Decision(path, "forced", why=why)  # Said by the user: no note.
            return
        if self.decision is not None and self.decision.how == "forced":
            self.decision = None  # Forced by the last call only: ours to choose again.
        if self.decision is not None or self._units:
            return
        refused = None if self.refuses is None else self.refuses()
        if refused is not None:
            self.failed(ValueError(refused))
            return
        remembered = _remembered(self.fingerprint)
        if self.agree is not None:
            # Every process takes what it remembers only where all remember the same.
            code = 0.0 if remembered is None else (1.0 if remembered.path == COMPILED else 2.0)
            high, low = self.agree([code, -code])
            if high != -low:
                remembered = None
        if remembered is not None:
            how = "remembered" if remembered.how == "measured" else remembered.how
            self._set(dataclasses.replace(remembered, how=how), store=False)

    def _at_agreement_point(self) -> bool:
        return self.agree is None or self._units % AGREE_EVERY == 0

    def _plain_step(self) -> float:
        recent = self._plain[-5:] or self._samples[PLAIN][-5:]
        return statistics.median(recent) if recent else 0.0

    def _nothing_to_gain(self) -> bool:
        if self.most_saved_s is None:
            return False
        step = self._plain_step()
        if self.agree is not None:
            (step,) = self.agree([step])
        return self.most_saved_s < MARGIN * step

    def _worth_a_trial(self, call: Call) -> bool:
        step = self._plain_step()
        spent = self._plain_spent + step * call.left()
        if self.agree is not None:
            spent, step = self.agree([spent, step])
        return spent >= max(trial_after_s(self.backend), TRIAL_RISK_STEPS * step)

    def _maybe_decide(self) -> None:
        plain, compiled = self._samples[PLAIN], self._samples[COMPILED]
        reference = statistics.median(plain) if plain else self._plain_step()
        need = TRIAL_UNITS[self.backend]
        # A compiled way far slower than the plain one is given up after one timed unit.
        early = self.agree is None and compiled and compiled[0] > SLOWER * reference > 0
        if not early and (len(plain) < need or len(compiled) < need):
            return
        plain_s = reference
        compiled_s = statistics.median(compiled)
        if self.agree is not None:
            plain_s, compiled_s = self.agree([plain_s, compiled_s])
        path = COMPILED if compiled_s <= (1.0 - MARGIN) * plain_s else PLAIN
        compile_s = None
        if self._compile is not None:
            seconds, steps = self._compile
            compile_s = max(0.0, seconds - steps * compiled_s)
        self._set(Decision(path, "measured", plain_s, compiled_s, compile_s))

    def _set(self, decision: Decision, store: bool = True) -> None:
        self.decision = decision
        self.trial = False
        if store and decision.how in ("measured", "failed"):
            # What it was measured on, for a reader of the file (not part of the key).
            about = {"model": self.model_name, "kind": self.kind, "backend": self.backend}
            choice_cache.remember(self.fingerprint, {**dataclasses.asdict(decision), **about})
        if self.announce is not None and self._call is not None and self._call.verbose:
            self.announce(note(self.model_name, self.kind, self.names, decision))


def _remembered(fingerprint: str | None) -> Decision | None:
    entry = choice_cache.lookup(fingerprint)
    if not isinstance(entry, dict) or entry.get("path") not in (PLAIN, COMPILED):
        return None
    fields = {f.name for f in dataclasses.fields(Decision)}
    try:
        return Decision(**{k: v for k, v in entry.items() if k in fields})
    except TypeError:  # An entry of another layout: measured again.
        return None


def note(model_name: str, kind: str, names: dict[str, str], decision: Decision) -> str:
    """One line on a decision, as the Accelerator prints it."""
    chosen, other = names[decision.path], names[COMPILED if decision.path == PLAIN else PLAIN]
    head = f"keras_accel: {model_name!r} runs its {kind} steps {chosen}"
    if decision.how == "failed":
        return (
            f"{head}: compiling them failed ({decision.why}); the same numbers, as Keras "
            f"runs them. {ENVIRONMENT}=0 skips the attempt."
        )
    if decision.why == "nothing to gain":
        return (
            f"{head} ({_ms(decision.plain_step_s)} a step, of which {names[COMPILED]} could "
            f"save only the host's per-call work, under {MARGIN:.0%}). {ENVIRONMENT}=1 or 0 "
            "(or Accelerator(jit_compile=...)) forces either."
        )
    times = (
        f"{_ms(decision.plain_step_s)} a step {names[PLAIN]}, "
        f"{_ms(decision.compiled_step_s)} {names[COMPILED]}"
    )
    if decision.compile_s is not None:
        times += f", compiling took {decision.compile_s:.1f} s"
    when = "measured on its own steps" if decision.how == "measured" else "as measured before"
    return (
        f"{head} ({times}; {when}): faster than {other}, with the same numbers up to float "
        f"rounding. {ENVIRONMENT}=1 or 0 (or Accelerator(jit_compile=...)) forces either."
    )


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds * 1e3:.3g} ms"


def clock() -> float:
    """The clock units are timed with (a function, so that tests can replace it)."""
    return time.perf_counter()
