"""Messages of `verbose=1`, where Keras's own callbacks send theirs.

Keras prints through its private `keras.src.utils.io_utils.print_msg`: to stdout while
interactive logging is on (the default), to absl logging at INFO level once
`keras.config.disable_interactive_logging()` was called (a server job). The same switch is
public (`keras.config.is_interactive_logging_enabled`), and absl is a dependency of Keras, so
this needs no private module: our messages go where the user told Keras to send its own.
"""

from __future__ import annotations

import sys

import keras
from absl import logging as absl_logging


def print_msg(message: str, line_break: bool = True) -> None:
    """Print `message` to stdout (interactive logging) or log it at INFO level via absl."""
    message = str(message)
    if not keras.config.is_interactive_logging_enabled():
        absl_logging.info(message)
        return
    text = f"{message}\n" if line_break else message
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:
        # A stdout in another encoding (redirected to a file on some systems): drop what it
        # cannot show rather than fail the training run over a log line.
        encoding = sys.stdout.encoding or "utf-8"
        sys.stdout.write(text.encode(encoding, errors="replace").decode(encoding))
    sys.stdout.flush()
