"""When a backup is due: batches counted across epochs (a fused group counts all of its
batches), `save_freq` checked, the backup's number for a position, fusion groups that end
where a backup falls."""

import pytest

from keras_accel.state import schedule

pytestmark = pytest.mark.torch  # Pure counting, the same on every backend.


def test_batches_are_counted_across_epochs_and_a_backup_falls_every_n():
    counted = schedule.Schedule()
    due = []
    for epoch in range(2):
        for batch in range(3):
            counted.count(epoch, batch)
            if counted.due(4):
                due.append((epoch, batch))
                counted.saved()
    assert counted.steps_done == 6 and due == [(1, 0)]


def test_a_fused_group_counts_all_of_its_batches():
    counted = schedule.Schedule()
    counted.count(0, 3)  # One group of 4 batches ends at batch 3.
    counted.count(0, 7)
    assert counted.steps_done == 8 and counted.due(8) and not counted.due("epoch")


def test_a_resume_counts_on_from_the_backup():
    counted = schedule.Schedule()
    counted.resume(10, epoch=2, batch=2)  # 4 batches an epoch: 2 epochs, then 2 batches.
    counted.count(2, 2)
    assert (counted.steps_done, counted.last_saved) == (11, 10)


def test_save_freq_is_epoch_a_positive_count_or_false():
    for good in ("epoch", 1, 50, False):
        schedule.check_save_freq(good)
    for bad in (0, -1, True, "batch", 1.5):
        with pytest.raises(ValueError, match="Invalid value for argument `save_freq`"):
            schedule.check_save_freq(bad)


def test_backups_are_numbered_by_position_and_fusion_groups_end_at_them():
    assert schedule.step_of(2, 3, steps_per_epoch=10, steps_done=99) == 23
    assert schedule.step_of(2, 3, steps_per_epoch=None, steps_done=99) == 99
    assert schedule.fusion_period(6, "train", 8) == 2
    assert schedule.fusion_period(6, "train", None) == 6
    assert schedule.fusion_period("epoch", "train", 8) is None
    assert schedule.fusion_period(6, "evaluate", 8) is None
