"""Attribute changes that last exactly as long as one Accelerator call.

keras_accel installs a few things on the user's own objects for one call (step wrappers,
masked metrics, BatchNormalization moments, the optimizers' gradient sums: see
`keras_accel.adapter.session`). `Patches` records each change with what was there before,
and `restore()` undoes them in reverse order, so that after the call the model, its layers
and its optimizers are exactly as they were: an attribute that did not exist is deleted
again, one that did gets its old value back.

It changes instances only, never a class or a module: those every thread of the process
shares (a plain `model.fit` running beside the call would see the change), and a class
attribute would reach every other instance too.
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
        """Set `obj.name = value` until `restore()`, on the instance `obj`.

        The instance is changed through its `__dict__` (bypassing Keras's attribute
        tracking, which must not track our wrappers).

        Raises:
            TypeError: `obj` is a class or a module (see the module docstring).
        """
        if isinstance(obj, (type, types.ModuleType)):
            raise TypeError(
                "keras_accel changes an instance for the duration of a call, never a class "
                "or a module, which every thread and every other instance share. Received: "
                f"{'class' if isinstance(obj, type) else 'module'} {obj.__name__!r}, "
                f"attribute {name!r}."
            )
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
