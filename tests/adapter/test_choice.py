"""The compiled-or-plain choice (`keras_accel.adapter.choice`) as a runner drives it, with
the times each way takes given: when a trial starts, what it runs, what it keeps and says,
what forces a way, what is remembered and under which fingerprint, and how several
processes agree. The backends' runners are tested in tests/adapter/test_tf_choice.py and
tests/adapter/test_torch_compiled.py."""

import os
import subprocess
import sys
import threading

import keras
import pytest

from keras_accel.adapter import choice, choice_cache

pytestmark = pytest.mark.torch  # No backend's steps run here: every lane checks it.

NAMES = {choice.PLAIN: "the plain way", choice.COMPILED: "the compiled way"}


class Model:
    """What a Choice reads of a model."""

    def __init__(self, jit_compile=False, run_eagerly=False):
        self.name = "toy"
        self.jit_compile = jit_compile
        self.run_eagerly = run_eagerly


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(choice_cache, "_DECISIONS", {})
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_CACHE", "0")
    monkeypatch.delenv("KERAS_ACCEL_JIT_COMPILE", raising=False)
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_AFTER", "1.0")


def _drive(runner, model, times, units=1000, group=32, call_steps=None, notes=None):
    """Run `units` host calls of `group` steps through `runner`, each way taking `times[way]`
    seconds a step (a compiled way's first unit 2 s more): the ways the units took."""
    taken = []
    with choice.in_call(model, {"train": call_steps}, verbose=notes is not None):
        for _ in range(units):
            left = group
            while left:
                path, steps = runner.unit(left)
                taken.append((path, steps))
                first = path == choice.COMPILED and runner._first[choice.COMPILED]
                runner.record(path, times[path] * steps + (2.0 if first else 0.0), steps)
                left -= steps
            if runner.decision is not None and len(taken) > 40:
                break
    return taken


def test_the_trial_waits_for_a_compilation_s_worth_of_plain_steps_then_keeps_the_faster():
    model = Model()
    runner = choice.Choice("tensorflow", NAMES, model, "train")
    times = {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}  # 32 ms a plain group.
    taken = _drive(runner, model, times)
    first_compiled = taken.index((choice.COMPILED, 32))
    # 1 s of plain steps first: the untimed first group, then 32 groups of 32 ms.
    assert first_compiled == 1 + 32
    # The compilation, then the two ways in turn until each has 3 timed groups.
    trial = [path for path, _ in taken[first_compiled : first_compiled + 7]]
    assert trial == ["compiled"] + ["compiled", "plain"] * 3
    decision = runner.decision
    assert (decision.path, decision.how) == (choice.COMPILED, "measured")
    assert decision.plain_step_s == pytest.approx(1e-3)
    assert decision.compiled_step_s == pytest.approx(2e-4)
    assert decision.compile_s == pytest.approx(2.0)
    assert taken[-1] == (choice.COMPILED, 32) and runner.timed() is False


def test_a_long_call_starts_its_trial_at_once_and_a_short_one_never():
    times = {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}
    model = Model()
    long = choice.Choice("tensorflow", NAMES, model, "train")
    taken = _drive(long, model, times, call_steps=2000 * 32)  # 64 s of plain steps ahead.
    assert taken[2] == (choice.COMPILED, 32)  # After one timed plain group.
    short = choice.Choice("tensorflow", NAMES, model, "train")
    taken = _drive(short, model, times, units=20, call_steps=20 * 32)  # 0.6 s in all.
    assert {path for path, _ in taken} == {choice.PLAIN} and short.decision is None


def test_short_calls_add_up_to_a_trial():
    model = Model()
    runner = choice.Choice("tensorflow", NAMES, model, "train")
    times = {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}
    calls = [_drive(runner, model, times, units=10, call_steps=320) for _ in range(5)]
    assert all(path == choice.PLAIN for call in calls[:3] for path, _ in call)
    assert (choice.COMPILED, 32) in calls[3]  # 1 s of plain steps over the four calls.


def test_a_tie_keeps_the_plain_way_and_a_much_slower_compiled_way_is_given_up_after_one_step():
    model = Model()
    tie = choice.Choice("tensorflow", NAMES, model, "train")
    _drive(tie, model, {choice.PLAIN: 1e-3, choice.COMPILED: 0.97e-3}, call_steps=10**6)
    assert tie.decision.path == choice.PLAIN  # Within MARGIN: no compiler needed.
    # The seed CNN's convolutions took 74 times as long a step with XLA: with plain steps
    # this slow, the compiled way runs one step to compile and one timed, then stops.
    times = {choice.PLAIN: 0.45, choice.COMPILED: 33.0}
    slow = choice.Choice("tensorflow", NAMES, model, "train")
    taken = _drive(slow, model, times, group=4, units=6, call_steps=10**4)
    compiled = [unit for unit in taken if unit[0] == choice.COMPILED]
    assert compiled == [(choice.COMPILED, 1), (choice.COMPILED, 1)]
    assert slow.decision.path == choice.PLAIN and slow.decision.compiled_step_s == 33.0
    after = taken.index((choice.COMPILED, 1)) + 2
    assert taken[after] == (choice.PLAIN, 2)  # The rest of that group, the plain way.
    # A program whose first step runs apart from its loop times two steps (one in the loop).
    peeled = choice.Choice("tensorflow", NAMES, model, "train", slow_units=(1, 2))
    taken = _drive(peeled, model, times, group=4, units=6, call_steps=10**4)
    assert [u for u in taken if u[0] == choice.COMPILED] == [("compiled", 1), ("compiled", 2)]


def test_slow_steps_need_a_long_run_at_stake_before_a_trial():
    # Its worst case (a compiled way 100 times as slow for two steps) must be small against
    # the time at stake: 200 plain steps' worth, here 90 s, not the 1 s of small steps.
    model = Model()
    times = {choice.PLAIN: 0.45, choice.COMPILED: 0.3}
    short = choice.Choice("tensorflow", NAMES, model, "train")
    taken = _drive(short, model, times, group=4, units=20, call_steps=80)  # 36 s in all.
    assert {path for path, _ in taken} == {choice.PLAIN} and short.decision is None
    long = choice.Choice("tensorflow", NAMES, model, "train")
    taken = _drive(long, model, times, group=4, units=20, call_steps=400)  # 180 s ahead.
    assert (choice.COMPILED, 1) in taken


def test_the_decision_is_said_once_with_both_times(capsys):
    model = Model()
    runner = choice.Choice("tensorflow", NAMES, model, "train", announce=print)
    _drive(runner, model, {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}, notes=True)
    _drive(runner, model, {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}, notes=True)
    out = capsys.readouterr().out
    assert out.count("keras_accel:") == 1
    assert (
        "'toy' runs its train steps the compiled way (1 ms a step the plain way, 0.2 ms "
        "the compiled way, compiling took 2.0 s; measured on its own steps)" in out
    )
    assert "KERAS_ACCEL_JIT_COMPILE=1 or 0" in out


def test_what_forces_a_way(monkeypatch):
    times = {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}

    def ways(model, setting=choice.AUTO):
        runner = choice.Choice("tensorflow", NAMES, model, "train")
        with choice.in_call(model, {"train": 10**6}, False, setting):
            for _ in range(40):
                path, steps = runner.unit(32)
                runner.record(path, times[path] * steps, steps)
        return runner.decision.how, runner.decision.path, runner.decision.why

    assert ways(Model(), setting=False) == ("forced", "plain", "Accelerator(jit_compile=False)")
    assert ways(Model(run_eagerly=True), setting=True)[:2] == ("forced", "plain")
    assert ways(Model(jit_compile=True))[:2] == ("forced", "compiled")
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE", "0")
    assert ways(Model(jit_compile=True)) == ("forced", "plain", "KERAS_ACCEL_JIT_COMPILE=0")
    assert ways(Model(), setting=True)[:2] == ("forced", "compiled")  # The argument first.
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="KERAS_ACCEL_JIT_COMPILE='sometimes'"):
        ways(Model())
    monkeypatch.delenv("KERAS_ACCEL_JIT_COMPILE")
    assert ways(Model())[:2] == ("measured", "compiled")


def test_a_forced_call_then_an_auto_one_measures():
    model = Model()
    runner = choice.Choice("tensorflow", NAMES, model, "train")
    with choice.in_call(model, {"train": 64}, False, False):
        assert runner.unit(32) == (choice.PLAIN, 32)
    assert runner.decision.how == "forced"
    _drive(runner, model, {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}, call_steps=10**6)
    assert runner.decision.how == "measured"


def test_bad_settings_name_what_was_received():
    assert choice.check_setting("auto") == choice.AUTO
    assert choice.check_setting(True) is True
    with pytest.raises(ValueError, match=r"Received: jit_compile='yes'"):
        choice.check_setting("yes")


def test_a_refused_compilation_runs_plain_and_is_said(capsys):
    model = Model()
    runner = choice.Choice("torch", NAMES, model, "train", announce=print)
    with choice.in_call(model, {"train": 10}, True):
        runner.unit(1)
        runner.failed(RuntimeError("no kernel for this op\nmore"))
        assert runner.unit(1) == (choice.PLAIN, 1)
    assert runner.decision.how == "failed"
    assert "compiling them failed (RuntimeError: no kernel for this op)" in capsys.readouterr().out


def test_a_decision_is_remembered_by_fingerprint_in_the_process_and_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_CACHE", "1")
    monkeypatch.setattr(choice_cache, "path", lambda: str(tmp_path / "choices.json"))
    model = Model()
    times = {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4}
    first = choice.Choice("tensorflow", NAMES, model, "train", fingerprint="abc")
    _drive(first, model, times, call_steps=10**6)
    assert first.decision.path == choice.COMPILED
    assert (tmp_path / "choices.json").exists()
    for forget in (False, True):  # This process's memory, then the file's.
        if forget:
            choice_cache.forget()
        again = choice.Choice("tensorflow", NAMES, model, "train", fingerprint="abc")
        taken = _drive(again, model, times, units=3, call_steps=96)
        assert taken == [(choice.COMPILED, 32)] * 3  # No trial: straight to the faster way.
        assert again.decision.how == "remembered"
        assert again.decision.compiled_step_s == pytest.approx(2e-4)
    other = choice.Choice("tensorflow", NAMES, model, "train", fingerprint="abd")
    _drive(other, model, times, units=3, call_steps=96)
    assert other.decision is None  # Another fingerprint: measured anew.
    (tmp_path / "choices.json").write_text("{not json")  # Damaged: as if empty.
    choice_cache.forget()
    assert choice_cache.lookup("abc") is None


def _functional(units):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2)(keras.layers.Dense(units, activation="relu")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("adam", "mse")
    return model


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_the_fingerprint_holds_what_decides_and_nothing_else(monkeypatch):
    signature = [[[32, 64, 4], "float32"]]
    a, b = _functional(8), _functional(8)  # Other layer names: the same architecture.
    key = choice_cache.fingerprint(a, "train", signature)
    assert key == choice_cache.fingerprint(b, "train", signature)
    assert key != choice_cache.fingerprint(_functional(9), "train", signature)
    assert key != choice_cache.fingerprint(a, "test", signature)
    assert key != choice_cache.fingerprint(a, "train", [[[32, 32, 4], "float32"]])
    assert key != choice_cache.fingerprint(a, "train", signature, {"device": "gpu:0"})
    b.compile("sgd", "mse")
    assert key != choice_cache.fingerprint(b, "train", signature)
    monkeypatch.setattr(keras, "__version__", "9.9.9")
    assert key != choice_cache.fingerprint(a, "train", signature)
    # A model of the user's own class: its source is part of the key.
    subclassed = Subclassed()
    subclassed.compile("adam", "mse")
    assert choice_cache.fingerprint(subclassed, "train", signature) is not None


def test_several_processes_take_the_same_way_at_the_same_unit():
    """Two processes in lockstep whose own times disagree (the compiled way faster in one,
    slower in the other) agree on each step's way: decisions on agreed values (each
    value's maximum over the processes), at the same units."""
    barrier = threading.Barrier(2)
    posted: list = [None, None]

    def agree_for(rank):
        def agree(values):
            posted[rank] = list(values)
            barrier.wait()
            result = [max(a, b) for a, b in zip(posted[0], posted[1])]
            barrier.wait()
            return result

        return agree

    timings = [
        {choice.PLAIN: 1e-3, choice.COMPILED: 2e-4},
        {choice.PLAIN: 1e-3, choice.COMPILED: 2e-3},
    ]
    taken: list = [None, None]
    runners = []

    def run(rank):
        model = Model()
        runner = choice.Choice("torch", NAMES, model, "train", agree=agree_for(rank))
        runners.append(runner)
        with choice.in_call(model, {"train": 10**6}, False):
            ways = []
            for _ in range(200):
                path, steps = runner.unit(1)
                ways.append(path)
                runner.record(path, timings[rank][path], steps)
            taken[rank] = ways

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert taken[0] == taken[1]
    assert choice.COMPILED in taken[0]  # A trial ran, the same units in both,
    assert taken[0][-1] == choice.PLAIN  # and the slowest process decided for both.
    assert {r.decision.path for r in runners} == {choice.PLAIN}


def test_the_fingerprint_leaves_tensorflow_unimported_on_the_other_backends():
    """Keras's serialization imports TensorFlow to ask whether an object is one of its
    types (150 MB and 3 s in a torch process): the fingerprint holds that off, with the same
    key as where TensorFlow is imported, and leaves Keras asking again afterwards."""
    script = """
import sys
import keras
from keras_accel.adapter import choice_cache
from keras.src.utils import module_utils

model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
model.compile("adam", "mse")
key = choice_cache.fingerprint(model, "train", [[[8, 4], "float32"]])
print(key, "tensorflow" in sys.modules, module_utils.tensorflow._available)
import tensorflow
print(choice_cache.fingerprint(model, "train", [[[8, 4], "float32"]]))
"""
    backend = "jax" if keras.backend.backend() == "tensorflow" else keras.backend.backend()
    env = {**os.environ, "KERAS_BACKEND": backend}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = result.stdout.split("\n")[:2]
    key, imported, available = first.split()
    assert (imported, available) == ("False", "None"), first
    assert key == second, (first, second)
