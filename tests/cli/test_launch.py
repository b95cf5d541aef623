"""`keras-accel launch`: N processes, their output, and how a launch ends. Plain Python
children here (no Keras): the multi-process training runs are in tests/distributed."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from keras_accel.cli.launch import describe_exit, free_ports, process_env


def _launch(tmp_path, body, *options, timeout=60, env=None, **popen):
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body))
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", *options, str(script)]
    if popen:
        return subprocess.Popen(command, text=True, env=env, **popen)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def test_each_process_gets_the_cluster_environment():
    ports = [1111, 2222]
    env = process_env(1, ports, devices_per_process=4)
    assert env["KERAS_DISTRIBUTION_JOB_ADDRESSES"] == "127.0.0.1:1111"
    assert env["KERAS_DISTRIBUTION_NUM_PROCESSES"] == "2"
    assert env["KERAS_DISTRIBUTION_PROCESS_ID"] == "1"
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["127.0.0.1:1111", "127.0.0.1:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    assert env["JAX_NUM_CPU_DEVICES"] == "4"
    assert "JAX_NUM_CPU_DEVICES" not in process_env(0, ports, None)
    assert len(set(free_ports(3))) == 3


def test_output_is_prefixed_and_success_is_zero(tmp_path):
    result = _launch(
        tmp_path,
        """
        import os, sys
        i = os.environ["KERAS_DISTRIBUTION_PROCESS_ID"]
        print(f"hello from {i} of {os.environ['KERAS_DISTRIBUTION_NUM_PROCESSES']}")
        print("to stderr", file=sys.stderr)
        """,
        "-n",
        "3",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for i in range(3):
        assert f"[{i}] hello from {i} of 3" in lines
        assert f"[{i}] to stderr" in lines


def test_a_failure_stops_the_others_and_is_named(tmp_path):
    started = time.monotonic()
    result = _launch(
        tmp_path,
        """
        import os, time
        if os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] == "1":
            raise SystemExit(3)
        time.sleep(300)
        """,
        "-n",
        "2",
        "--grace",
        "5",
        timeout=240,
    )
    # Not the survivor's 300 s; the margin holds on a loaded machine (the suite runs both
    # backends side by side, and the launcher and its children start Python each).
    assert time.monotonic() - started < 120
    assert result.returncode == 3
    assert "process 1 (pid" in result.stderr and "failed: exit code 3" in result.stderr
    assert "exit codes [-15, 3]" in result.stderr  # The survivor was stopped by SIGTERM.


# Process 1 stops itself (SIGSTOP: a stuck host, a frozen file system); process 0 goes on, as
# a healthy process waiting in a collective with it does.
STOPS = """
import os, signal, time
if os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] == "1":
    os.kill(os.getpid(), signal.SIGSTOP)
time.sleep({healthy_s})
raise SystemExit("process 0: the collective with process 1 timed out")
"""


def test_a_stopped_process_is_named_not_the_healthy_one_that_failed_on_it(tmp_path):
    """Before: "process 0 failed", and process 1 (the one that stopped) never named."""
    started = time.monotonic()
    result = _launch(tmp_path, STOPS.format(healthy_s=3), "-n", "2", "--grace", "5", timeout=120)
    assert time.monotonic() - started < 60
    assert "process 1 (pid " in result.stderr, result.stderr
    assert (
        ") stopped answering: it has been stopped (state T: SIGSTOP, job control) for "
        in result.stderr
    )
    assert "s, and process 0 failed on it (exit code 1)." in result.stderr
    assert "process 0 (pid" not in result.stderr  # Not named as the cause.
    assert "failed: process 1 stopped answering (stopped for " in result.stderr
    assert "exit codes [1, -9]" in result.stderr  # The stopped one killed, not left behind.
    assert result.returncode == 137


def test_a_process_stopped_past_the_stall_timeout_ends_the_launch(tmp_path):
    """Its peers would otherwise wait for their collectives' own timeouts (42-138 s)."""
    started = time.monotonic()
    result = _launch(
        tmp_path,
        STOPS.format(healthy_s=300),
        "-n",
        "2",
        "--grace",
        "5",
        "--stall-timeout",
        "2",
        timeout=120,
    )
    assert time.monotonic() - started < 60
    assert (
        "stopped answering: it has been stopped (state T: SIGSTOP, job control) for more "
        "than --stall-timeout 2 s. SIGKILL to it; stopping the others" in result.stderr
    ), result.stderr
    assert "exit codes [-15, -9]" in result.stderr
    assert result.returncode == 137


def test_a_process_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    # No timing races on a loaded machine: process 1 dies only once process 0 has said (a file)
    # that its SIGTERM handler is installed, so the launcher's SIGTERM is always ignored, and
    # the SIGKILL after the grace is what ends it. What is checked is the order of events and
    # a lower bound on the time (load only adds to it). The grace leaves the handler 5 s to
    # print, ample for a process starved on a loaded 2-core machine (a 1 s grace was not).
    grace = 5
    ready = tmp_path / "handler_installed"
    started = time.monotonic()
    result = _launch(
        tmp_path,
        f"""
        import os, pathlib, signal, sys, time
        ready = pathlib.Path({str(ready)!r})
        if os.environ["KERAS_DISTRIBUTION_PROCESS_ID"] == "1":
            deadline = time.monotonic() + 120
            while not ready.exists():
                if time.monotonic() > deadline:
                    sys.exit(5)  # Process 0 never got going: not what this test is about.
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)
        def ignore(signum, frame):
            print("ignoring SIGTERM", flush=True)
        signal.signal(signal.SIGTERM, ignore)
        # CLOCK_MONOTONIC is one clock for every process: the test reads the time back.
        ready.write_text(repr(time.monotonic()))
        time.sleep(300)
        """,
        "-n",
        "2",
        "--grace",
        str(grace),
        timeout=240,
    )
    ended = time.monotonic()
    assert ended - started < 200, result.stderr  # Not the survivor's 300 s.
    assert result.returncode == 137, result.stderr  # 128 + SIGKILL, as a shell reports it.
    assert "[0] ignoring SIGTERM" in result.stdout.splitlines(), result.stdout
    # The SIGTERM came after the handler was installed, the SIGKILL `grace` s after it.
    assert ended - float(ready.read_text()) >= grace, result.stderr
    err = result.stderr
    failed = err.index("process 1 (pid")
    assert "failed: killed by SIGKILL" in err[failed:].splitlines()[0]
    killed = err.index(f"process(es) [0] still running {grace} s after SIGTERM")
    summary = err.index("failed: process 1 (killed by SIGKILL); exit codes [-9, -9].")
    assert failed < killed < summary  # SIGTERM first, SIGKILL after the grace, then the end.


def test_sigterm_to_the_launcher_reaches_every_process(tmp_path):
    ready = tmp_path / "ready"
    process = _launch(
        tmp_path,
        f"""
        import os, pathlib, signal, sys, time
        def stop(signum, frame):
            print("saving", flush=True)
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        pathlib.Path({str(ready)!r} + os.environ["KERAS_DISTRIBUTION_PROCESS_ID"]).touch()
        time.sleep(300)
        """,
        "-n",
        "2",
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120  # Start-up, with margin for a loaded machine.
        while not all(os.path.exists(f"{ready}{i}") for i in range(2)):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143
    assert "[0] saving" in out and "[1] saving" in out
    assert "preempted" in err and "every process saved and exited" in err


@pytest.mark.parametrize("backend_name", ["tensorflow", "jax"])
def test_devices_per_process_on_tensorflow_is_a_note_not_silence(tmp_path, backend_name):
    env = dict(os.environ, KERAS_BACKEND=backend_name)
    result = _launch(tmp_path, "print('ran')", "-n", "2", "--devices-per-process", "4", env=env)
    assert result.returncode == 0, result.stderr
    assert "[0] ran" in result.stdout and "[1] ran" in result.stdout
    notes = [line for line in result.stderr.splitlines() if "--devices-per-process" in line]
    if backend_name == "jax":
        assert notes == []  # It applies: JAX splits each process's CPU into 4 devices.
        return
    assert len(notes) == 1, result.stderr
    assert notes[0].startswith("keras-accel launch: note: --devices-per-process 4 is ignored ")
    assert "on the tensorflow backend (from the KERAS_BACKEND environment variable)" in notes[0]
    assert "only JAX reads" in notes[0] and "one CPU device" in notes[0]
    assert "2 replica(s), one per process" in notes[0]


@pytest.mark.parametrize(
    "options, message",
    [
        (["-n", "0"], "-n/--num-processes must be at least 1. Received: 0"),
        (["-n", "2", "--devices-per-process", "0"], "--devices-per-process must be at least 1"),
        (["-n", "2", "--grace", "-1"], "--grace must be 0 or more seconds. Received: -1"),
        (["-n", "2", "--stall-timeout", "-1"], "--stall-timeout must be 0 (never) or more"),
    ],
)
def test_bad_arguments_are_named(tmp_path, options, message):
    result = _launch(tmp_path, "print('never')", *options)
    assert result.returncode == 2
    assert message in result.stderr and "never" not in result.stdout


def test_a_missing_script_is_named():
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2", "nope.py"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "No such script: 'nope.py'" in result.stderr


def test_exit_descriptions():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"
