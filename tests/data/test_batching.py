"""Static batching math: sizes, padding, weights, permutations (numpy only)."""

import numpy as np
import pytest

from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import BatchPlan, pad_batch, static_batch_size


def test_static_batch_size_rounds_up_to_replicas():
    assert static_batch_size(16, 8) == 16
    assert static_batch_size(100, 8) == 104
    assert static_batch_size(3, 1) == 3
    assert static_batch_size(4, 8) == 8  # Below the replica count: one row per replica.
    assert static_batch_size(1, 8) == 8
    with pytest.raises(ValueError, match="Received: batch_size=0"):
        static_batch_size(0, 1)
    with pytest.raises(TypeError, match="batch_size=2.5"):
        static_batch_size(2.5, 1)


def test_padding_weights_give_real_row_mean_in_training():
    x = np.arange(6, dtype="float32").reshape(3, 2)
    px, py, sw, mask = pad_batch(x, np.array([1, 2, 3]), None, rows=8, weight_scale=8 / 3)
    assert px.shape == (8, 2) and py.shape == (8,)
    # Padding rows are copies of the last real row (values user code handles), weighted 0.
    np.testing.assert_array_equal(px[3:], np.repeat(x[-1:], 5, axis=0))
    np.testing.assert_array_equal(py[3:], 3)
    np.testing.assert_array_equal(sw[3:], 0)
    np.testing.assert_array_equal(mask, [1, 1, 1, 0, 0, 0, 0, 0])
    losses = np.array([1.0, 2.0, 6.0, 9, 9, 9, 9, 9])
    # Keras's sum_over_batch_size: sum(w * l) / rows.
    assert np.isclose((sw * losses).sum() / 8, 3.0)


def test_evaluation_weights_make_keras_batch_average_exact():
    plan = BatchPlan(num_samples=10, batch_size=4, static_rows=4, training=False)
    losses = np.arange(10, dtype="float64")
    batch_losses = []
    for i in range(plan.num_batches):
        real = losses[i * 4 : i * 4 + plan.rows_in_batch(i)]
        w = plan.weight_scales[i]
        batch_losses.append(w * real.sum() / 4)
    # Keras weights every batch's loss by its (static) row count.
    keras_mean = sum(4 * b for b in batch_losses) / (4 * plan.num_batches)
    assert np.isclose(keras_mean, losses.mean())


def test_one_table_of_rows_and_weights():
    train = BatchPlan(num_samples=20, batch_size=8, static_rows=8)
    np.testing.assert_array_equal(train.real_rows, [8, 8, 4])
    np.testing.assert_allclose(train.weight_scales, [1.0, 1.0, 2.0])
    assert train.pads and train.rows_seen == 20
    dropped = BatchPlan(num_samples=20, batch_size=8, static_rows=8, remainder="drop")
    assert not dropped.pads and dropped.rows_seen == 16
    evaluation = BatchPlan(num_samples=20, batch_size=8, static_rows=8, training=False)
    np.testing.assert_allclose(evaluation.weight_scales, [24 / 20] * 3)
    # Indivisible batches pad every batch: 6 real rows in 8 static ones.
    assert BatchPlan(num_samples=12, batch_size=6, static_rows=8, remainder="drop").pads


def test_padding_keeps_the_weight_shape_and_pads_strings_with_a_real_one():
    x = np.array([["a"], ["bc"]], dtype=object)
    px, _, sw, mask = pad_batch(x, np.zeros(2), np.ones((2, 1)), rows=4, weight_scale=2.0)
    assert px[:, 0].tolist() == ["a", "bc", "bc", "bc"]  # Never "": a lookup may refuse it.
    assert sw.shape == (4, 1) and sw[:, 0].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert mask.tolist() == [1, 1, 0, 0]


def test_drop_and_pad_batch_counts():
    assert BatchPlan(101, 16, 16, remainder="pad").num_batches == 7
    assert BatchPlan(101, 16, 16, remainder="drop").num_batches == 6
    with pytest.raises(ValueError, match="remainder='drop' with fewer samples"):
        BatchPlan(10, 16, 16, remainder="drop")
    with pytest.raises(ValueError, match="remainder='stretch'"):
        BatchPlan(10, 4, 4, remainder="stretch")


def test_array_batches_shuffle_per_epoch_and_cover_every_row():
    x = np.arange(20, dtype="float32")[:, None]
    batches = ArrayBatches(x, x[:, 0], batch_size=8, num_replicas=4, shuffle=True, seed=3)
    seen = [
        np.concatenate([batches.batch(i, epoch)[0][:, 0] for i in range(3)]) for epoch in (0, 1)
    ]
    for epoch_rows in seen:
        # 20 rows in 3 batches of 8: 4 padding zeros at the end of the last batch.
        assert sorted(epoch_rows[:20].tolist()) == list(range(20))
    assert not np.array_equal(seen[0][:20], seen[1][:20])
    again = ArrayBatches(x, x[:, 0], batch_size=8, num_replicas=4, shuffle=True, seed=3)
    np.testing.assert_array_equal(again.batch(0, 0)[0], batches.batch(0, 0)[0])


def test_length_mismatch_names_the_counts():
    with pytest.raises(ValueError, match=r"x: \[10\], y: \[9\]"):
        ArrayBatches(np.zeros((10, 2)), np.zeros(9), batch_size=4, num_replicas=1)
    with pytest.raises(ValueError, match=r"sample_weight: \[3\]"):
        ArrayBatches(np.zeros((10, 2)), np.zeros(10), np.ones(3), batch_size=4, num_replicas=1)


def test_class_weight_becomes_sample_weight():
    y = np.array([0, 1, 1, 2])
    batches = ArrayBatches(
        np.zeros((4, 1)), y, batch_size=4, num_replicas=1, class_weight={0: 1.0, 1: 2.0, 2: 0.5}
    )
    np.testing.assert_allclose(batches.batch(0)[2], [1.0, 2.0, 2.0, 0.5])
    # A class the dict does not name weighs 1.0, as in Keras; float targets are rounded.
    partial = ArrayBatches(
        np.zeros((4, 1)), y * 1.0 - 0.1, batch_size=4, num_replicas=1, class_weight={1: 2.0}
    )
    np.testing.assert_allclose(partial.batch(0)[2], [1.0, 2.0, 2.0, 1.0])
