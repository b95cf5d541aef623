"""Run one benchmark measurement in a child process under one Keras backend.

Every benchmark here measures each backend in its own process (a backend is chosen once per
process); the child prints its figures as one JSON line last.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys


def run_child(script: str, backend: str, argv: list[str], processes: int | None = None) -> dict:
    """`script argv --child` under `KERAS_BACKEND=backend`: its last stdout line as JSON,
    or `{"backend": ..., "error": ...}` naming the exit status and the error line.

    `processes`: N processes of it under `keras-accel launch -n N`, whose last stdout line
    (its last line that is JSON, the launcher's "[i] " prefix taken off) is the answer: one
    process prints for all."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    command = [sys.executable, script, *argv, "--child"]
    if processes is not None:
        launch = ["-m", "keras_accel.cli.main", "launch", "-n", str(processes)]
        command = [sys.executable, *launch, *command[1:]]
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        # Native crashes end in stack-frame lines; the message is the line before them.
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "@ 0x" not in ln]
        last = lines[-1] if lines else "no output"
        return {"backend": backend, "error": f"exit {result.returncode}: {last}"}
    lines = result.stdout.strip().splitlines()
    if processes is not None:  # Other processes may print after it: its last JSON line.
        lines = [ln.split("] ", 1)[1] for ln in lines if re.match(r"\[\d+\] \{", ln)]
    return json.loads(lines[-1])
