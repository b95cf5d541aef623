"""Run one benchmark measurement in a child process under one Keras backend.

Every benchmark here measures each backend in its own process (a backend is chosen once per
process); the child prints its figures as one JSON line last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_child(script: str, backend: str, argv: list[str]) -> dict:
    """`script argv --child` under `KERAS_BACKEND=backend`: its last stdout line as JSON,
    or `{"backend": ..., "error": ...}` naming the exit status and the error line."""
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, script, *argv, "--child"], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        # Native crashes end in stack-frame lines; the message is the line before them.
        lines = [ln for ln in result.stderr.splitlines() if ln.strip() and "@ 0x" not in ln]
        last = lines[-1] if lines else "no output"
        return {"backend": backend, "error": f"exit {result.returncode}: {last}"}
    return json.loads(result.stdout.strip().splitlines()[-1])
