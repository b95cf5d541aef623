"""Attribute changes that last exactly as long as one Accelerator call.

keras_accel installs a few things on the user's model (step wrappers, masked metrics,
BatchNormalization moments) and, on TensorFlow, on Keras itself (see
`keras_accel.adapter.backends.tensorflow`). `Patches` records each change with what was there
before, and `restore()` undoes them in reverse order, so that after the call the model, its
layers and Keras are exactly as they were: an attribute that did not exist is deleted again,
one that did gets its old value back.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

_MISSING = object()


class Patches:
    """A stack of attribute changes, undone by `restore()` (or on leaving a `with` block)."""

    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def set(self, obj: Any, name: str, value: Any) -> None:
        """Set `obj.name = value` until `restore()`.

        Instances are changed through their `__dict__` (bypassing Keras's attribute tracking,
        which must not track our wrappers); classes and modules with `setattr`.
        """
        if isinstance(obj, (type, types.ModuleType)):
            old = vars(obj).get(name, _MISSING)
            setattr(obj, name, value)

            def undo():
                if old is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)

        else:
            namespace = obj.__dict__
            old = namespace.get(name, _MISSING)
            object.__setattr__(obj, name, value)

            def undo():
                if old is _MISSING:
                    namespace.pop(name, None)
                else:
                    namespace[name] = old

        self._undo.append(undo)

    def set_item(self, mapping: dict, key: Any, value: Any) -> None:
        """Set `mapping[key] = value` until `restore()`."""
        old = mapping.get(key, _MISSING)
        mapping[key] = value

        def undo():
            if old is _MISSING:
                mapping.pop(key, None)
            else:
                mapping[key] = old

        self._undo.append(undo)

    def add(self, undo: Callable[[], None]) -> None:
        """Call `undo()` at `restore()`, in its turn: for a change that is not one attribute
        (a variable added to an optimizer's list, say), made by the caller."""
        self._undo.append(undo)

    def restore(self) -> None:
        """Undo every change, newest first. An undo that raises does not stop the others:
        each is tried, then the first error is raised (the later ones chained to it), so
        one failure never leaves the rest of the call's changes behind."""
        errors: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo()
            except BaseException as error:  # Raised below, after the rest are undone.
                errors.append(error)
        if errors:
            first = errors[0]
            if len(errors) > 1 and hasattr(first, "add_note"):  # Python 3.11+.
                first.add_note(
                    f"keras_accel: {len(errors) - 1} more undo(s) of this call also failed: "
                    + "; ".join(f"{type(e).__name__}: {e}" for e in errors[1:])
                )
            raise first

    def __enter__(self) -> Patches:
        return self

    def __exit__(self, *exc_info) -> bool:
        self.restore()
        return False

    def __len__(self) -> int:
        return len(self._undo)
