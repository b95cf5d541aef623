"""`keras-accel launch`: which process a failure names when several end together. Plain Python
children that act out a collective's breakage in order (files say when each step is done), so
the order of events is fixed whatever the machine's load: process 1 raises first, and process
0 fails because of it (as gloo's "Connection closed by peer" ends a peer). The real gloo runs
are in test_launch_children.py."""

import re
import subprocess
import sys
import textwrap
import time

import pytest

from keras_accel.cli.launch import CAUSE_WINDOW_S, TRACEBACK_END_S, TRACEBACK_SETTLE_S

TIMEOUT_S = 240  # A hang fails the test instead of stalling the suite.

# What both processes share: their index, their pid on a line, and a wait for a file that the
# other writes when it has done a step (a bounded wait: exit 5 says the other never got there).
PRELUDE = """
import os, pathlib, sys, time, traceback

here = pathlib.Path({here!r})
index = int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"])
print(f"pid {{os.getpid()}}", flush=True)

def wait_for(name):
    deadline = time.monotonic() + 120
    while not (here / name).exists():
        if time.monotonic() > deadline:
            print(f"gave up waiting for {{name}}", flush=True)
            os._exit(5)
        time.sleep(0.01)

def end_with(code, hold=0.0):
    # Process 1's excepthook: the traceback printed as Python prints it, the others told, then
    # the end (after `hold` s: a slow exit), as the Accelerator's hook ends a cluster process.
    def hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        sys.stderr.flush()
        (here / "1_printed").touch()
        time.sleep(hold)
        os._exit(code)
    sys.excepthook = hook

def broken_by_peer(how):
    # Process 0's end once process 1's traceback is out: the collective it is in fails. The
    # second's pause leaves the launcher ample time to read that traceback first.
    wait_for("1_printed")
    time.sleep(1.0)
    (here / "0_ending").touch()
    if how == "abort":  # gloo's C++ error ends the process without a Python traceback.
        print("terminate called after throwing an instance of 'gloo::IoException'", flush=True)
        print("  what():  Connection closed by peer", flush=True)
        os._exit(1)
    raise ConnectionError("Connection closed by peer")  # A Python traceback of its own.
"""

# Process 0 logs a caught exception at start-up (its traceback printed), goes on printing,
# and then fails only because process 1 raised; process 1 ends after process 0 does.
STALE_TRACEBACK = """
if index == 0:
    try:
        import a_module_that_is_not_installed  # An optional import, logged as it fails.
    except ImportError:
        traceback.print_exc()
        print("going on without it", flush=True)
    time.sleep({went_on_after})
    print("step 1", flush=True)  # Output well after that traceback: the process went on.
    (here / "0_went_on").touch()
    broken_by_peer({how!r})
else:
    wait_for("0_went_on")

    def after_process_0(kind, value, tb):  # Ends last: the first to end is not the cause.
        sys.__excepthook__(kind, value, tb)
        sys.stderr.flush()
        (here / "1_printed").touch()
        wait_for("0_ending")
        time.sleep(0.2)
        os._exit(1)

    sys.excepthook = after_process_0
    raise ValueError("boom in process 1")
"""

# Process 1 prints its traceback and takes 3 s to exit (longer than the launcher's first look
# at the others, well inside the time a traceback belongs to the end); process 0, broken by
# it, ends first: process 1 is still running when process 0's failure is seen.
SLOW_EXIT = """
if index == 0:
    broken_by_peer("abort")
else:
    time.sleep(0.5)
    end_with(7, hold={hold})
    raise ValueError("boom in process 1")
"""


def _launch(tmp_path, body, **values):
    script = tmp_path / "child.py"
    source = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    script.write_text(source.format(here=str(tmp_path), **values))
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2", str(script)]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )


def _pids(out):
    pids = dict(re.findall(r"^\[(\d)\] pid (\d+)$", out, flags=re.MULTILINE))
    return {int(index): int(pid) for index, pid in pids.items()}


@pytest.mark.parametrize("how", ["abort", "traceback"])
def test_a_traceback_the_process_went_on_from_does_not_make_it_the_cause(tmp_path, how):
    went_on_after = TRACEBACK_SETTLE_S + 1.5  # The launcher reads lines as they come.
    result = _launch(tmp_path, STALE_TRACEBACK, went_on_after=went_on_after, how=how)
    out, err = result.stdout, result.stderr
    assert "gave up waiting" not in out, out
    assert "[0] ModuleNotFoundError: No module named 'a_module_that_is_not_installed'" in out
    assert "[0] step 1" in out and "[1] ValueError: boom in process 1" in out
    if how == "traceback":
        assert "[0] ConnectionError: Connection closed by peer" in out
    pid = _pids(out)[1]
    # Process 0 ended first, and its only traceback before that came first, but it went on
    # from that one: process 1's error is what the launch ended with.
    assert f"process 1 (pid {pid}) failed: exit code 1." in err, err
    assert "process 0 (pid" not in err and "failed: process 0" not in err, err
    assert "failed: process 1 (exit code 1); exit codes [1, 1]." in err, err
    assert result.returncode == 1


def test_a_cause_still_exiting_when_its_peer_fails_is_waited_for_and_named(tmp_path):
    hold = 3.0
    assert CAUSE_WINDOW_S + 1 < hold < TRACEBACK_END_S - 5  # What the test is about, margins.
    started = time.monotonic()
    result = _launch(tmp_path, SLOW_EXIT, hold=hold)
    out, err = result.stdout, result.stderr
    assert "gave up waiting" not in out, out
    assert "[1] ValueError: boom in process 1" in out and "[0]   what():  Connection" in out
    pid = _pids(out)[1]
    # Named with its own pid and its own exit code (7), not a SIGTERM from the launcher: the
    # launcher waited for it instead of naming process 0, the first to end.
    assert f"process 1 (pid {pid}) failed: exit code 7. Stopping the other 0 process(es)" in err
    assert "process 0 (pid" not in err and "failed: process 0" not in err, err
    assert "failed: process 1 (exit code 7); exit codes [1, 7]." in err, err
    assert result.returncode == 7
    assert time.monotonic() - started < TIMEOUT_S / 2
