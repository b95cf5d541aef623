"""`Patches`: every change of one call undone, newest first, even when an undo raises."""

import sys
import types

import pytest

from keras_accel.adapter.patches import Patches


class _Thing:
    pass


def test_restore_gives_back_old_values_and_deletes_new_attributes():
    thing, module = _Thing(), types.ModuleType("fake")
    thing.kept, module.kept = 1, 2
    mapping = {"a": 1}
    patches = Patches()
    patches.set(thing, "kept", 10)
    patches.set(thing, "added", 11)
    patches.set(module, "kept", 20)
    patches.set(_Thing, "added", 30)
    patches.set_item(mapping, "a", 2)
    patches.set_item(mapping, "b", 3)
    assert (thing.kept, thing.added, module.kept, _Thing.added) == (10, 11, 20, 30)
    assert len(patches) == 6
    patches.restore()
    assert (thing.kept, module.kept, mapping) == (1, 2, {"a": 1})
    assert not hasattr(thing, "added") and "added" not in vars(_Thing)
    assert len(patches) == 0


def test_an_added_undo_runs_in_its_turn():
    thing, order = _Thing(), []
    thing.value = "original"
    patches = Patches()
    patches.set(thing, "value", "patched")
    patches.add(lambda: order.append(thing.value))
    patches.restore()
    # Newest first: the added undo saw the attribute still patched.
    assert order == ["patched"] and thing.value == "original"


def test_the_same_attribute_set_twice_comes_back_to_the_first_value():
    thing = _Thing()
    thing.value = "original"
    with Patches() as patches:
        patches.set(thing, "value", "first")
        patches.set(thing, "value", "second")
    assert thing.value == "original"


class _Frozen(types.ModuleType):
    """A module whose attribute `locked` cannot be set back: its undo raises."""

    def __setattr__(self, name, value):
        if name == "locked" and getattr(self, "_armed", False):
            raise RuntimeError(f"cannot set {name}")
        super().__setattr__(name, value)


def test_an_undo_that_raises_does_not_stop_the_others():
    before, after = _Thing(), _Thing()
    before.value = after.value = "original"
    frozen = _Frozen("frozen")
    frozen.locked = "original"
    patches = Patches()
    patches.set(before, "value", "patched")  # Undone last.
    patches.set(frozen, "locked", "patched")
    patches.set(after, "value", "patched")  # Undone first.
    frozen._armed = True
    with pytest.raises(RuntimeError, match="cannot set locked"):
        patches.restore()
    # Both sides of the failing undo were undone, and nothing is left to undo twice.
    assert before.value == "original" and after.value == "original"
    assert frozen.locked == "patched" and len(patches) == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_several_failing_undos_raise_the_first_and_name_the_others():
    frozen, other = _Frozen("frozen"), _Frozen("other")
    frozen.locked = other.locked = "original"
    patches = Patches()
    patches.set(frozen, "locked", 1)
    patches.set(other, "locked", 2)
    frozen._armed = other._armed = True
    with pytest.raises(RuntimeError, match="cannot set locked") as caught:
        patches.restore()
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and "1 more undo(s)" in notes[0] and "RuntimeError" in notes[0]
