"""`Patches`: every change of one call undone, newest first, even when an undo raises."""

import sys
import types

import pytest

from keras_accel.adapter.patches import Patches


class _Thing:
    pass


def test_restore_gives_back_old_values_and_deletes_new_attributes():
    thing = _Thing()
    thing.kept = 1
    mapping = {"a": 1}
    patches = Patches()
    patches.set(thing, "kept", 10)
    patches.set(thing, "added", 11)
    patches.set_item(mapping, "a", 2)
    patches.set_item(mapping, "b", 3)
    assert (thing.kept, thing.added) == (10, 11)
    assert len(patches) == 4
    patches.restore()
    assert (thing.kept, mapping) == (1, {"a": 1})
    assert not hasattr(thing, "added")
    assert len(patches) == 0


@pytest.mark.parametrize("shared", [_Thing, types.ModuleType("fake")], ids=["class", "module"])
def test_a_class_or_a_module_is_refused_and_left_as_it_was(shared):
    patches = Patches()
    with pytest.raises(TypeError, match=r"never a class or a module.*attribute 'added'"):
        patches.set(shared, "added", 1)
    assert "added" not in vars(shared) and len(patches) == 0


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


def _failing(message):
    def undo():
        raise RuntimeError(message)

    return undo


def test_an_undo_that_raises_does_not_stop_the_others():
    before, after = _Thing(), _Thing()
    before.value = after.value = "original"
    patches = Patches()
    patches.set(before, "value", "patched")  # Undone last.
    patches.add(_failing("cannot undo"))
    patches.set(after, "value", "patched")  # Undone first.
    with pytest.raises(RuntimeError, match="cannot undo"):
        patches.restore()
    # Both sides of the failing undo were undone, and nothing is left to undo twice.
    assert before.value == "original" and after.value == "original"
    assert len(patches) == 0


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_several_failing_undos_raise_the_first_and_name_the_others():
    patches = Patches()
    patches.add(_failing("undone last"))
    patches.add(_failing("undone first"))
    with pytest.raises(RuntimeError, match="undone first") as caught:
        patches.restore()
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and "1 more undo(s)" in notes[0] and "undone last" in notes[0]
