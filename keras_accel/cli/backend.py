"""Which Keras backend a command will get, read without importing Keras: `keras-accel`
and `keras-accel launch` say it before (or instead of) the import that needs it."""

from __future__ import annotations

import json
import os


def configured_backend() -> tuple[str, str]:
    """The backend Keras will load and where it comes from, read as Keras reads it but without
    importing Keras (for the message when that import fails): the KERAS_BACKEND variable, else
    the "backend" key of keras.json in KERAS_HOME (or ~/.keras), else "tensorflow"."""
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "from the KERAS_BACKEND environment variable"
    home = os.environ.get("KERAS_HOME")
    if home is None:
        base = os.path.expanduser("~")
        home = os.path.join(base if os.access(base, os.W_OK) else "/tmp", ".keras")
    config = os.path.expanduser(os.path.join(home, "keras.json"))
    try:
        with open(config) as f:
            chosen = json.load(f).get("backend")
    except (OSError, ValueError, AttributeError):
        chosen = None
    if chosen:
        return chosen, f"from {config}"
    return "tensorflow", "Keras's default"
