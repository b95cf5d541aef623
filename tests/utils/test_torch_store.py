"""torch's process-group store (`keras_accel.utils.process.torch_store`): a MASTER_PORT held by
another program fails within the heartbeat timeout on every rank, never hangs. Real processes
and a real socket holding the port."""

import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="torch.distributed's store"),
]

JOIN = "from keras_accel import Accelerator; Accelerator()"


def _join(rank, port, timeout_s):
    env = dict(
        os.environ,
        KERAS_BACKEND="torch",
        WORLD_SIZE="2",
        RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        KERAS_ACCEL_HEARTBEAT_TIMEOUT=str(timeout_s),
        PYTHONUNBUFFERED="1",
    )
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    command = [sys.executable, "-c", JOIN]
    # Without the bound, torch's client waits for ever for the holder's answer: 240 s is a
    # hang, far past the 3 + 5 s this should take even on a loaded machine.
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL
    )


def test_a_rank_past_0_names_a_port_held_by_another_program():
    with socket.socket() as holder:  # Accepts connections (the backlog) and never answers.
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        result = _join(1, port, timeout_s=3)
        took = time.monotonic() - started
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert "StoreUnanswered: Process 1 of 2 connected to 127.0.0.1:" in last, result.stderr
    assert f"another program holds MASTER_PORT={port}" in last
    assert "Choose a free MASTER_PORT" in last and "KERAS_ACCEL_HEARTBEAT_TIMEOUT" in last
    assert took >= 3  # It waited for the store's timeout first (a late rank 0 would answer).


def test_rank_0_still_names_the_port_in_use():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = _join(0, port, timeout_s=30)
    assert result.returncode != 0
    assert f"127.0.0.1:{port}" in result.stderr and "in use by another program" in result.stderr


def test_a_rank_whose_rank_0_never_comes_says_so():
    with socket.socket() as probe:  # A port nobody listens on: connections are refused.
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _join(1, port, timeout_s=3)
    assert result.returncode != 0
    assert "StoreUnanswered" not in result.stderr
    assert "waited 3 s for all 2 processes to join" in result.stderr, result.stderr[-2000:]
