"""How a global batch reaches the replicas on TensorFlow (`tf_shares.replica_slices`): replica i
gets the i-th contiguous slice of each batch, with every static dimension kept, and the
strategy's distributed data set hands them out as `experimental_distribute_dataset` would."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from keras_accel.data import tf_shares  # noqa: E402


def _batches(rows=8, features=3, count=3):
    def make(i):
        index = tf.range(rows) + tf.cast(i, tf.int32) * rows
        x = tf.cast(tf.tile(index[:, None], [1, features]), tf.float32)
        return x, index, tf.ones([rows])

    return tf.data.Dataset.range(count).map(make)


def test_each_batch_becomes_its_replicas_slices_in_order_with_static_shapes():
    sliced = tf_shares.replica_slices(_batches(), 4)
    x_spec, y_spec, w_spec = sliced.element_spec
    assert x_spec.shape.as_list() == [2, 3] and y_spec.shape.as_list() == [2]
    assert w_spec.shape.as_list() == [2]
    assert int(sliced.cardinality()) == 12  # 3 global batches of 4 slices.
    rows = [y.tolist() for _, y, _ in sliced.as_numpy_iterator()]
    assert rows == [[2 * i, 2 * i + 1] for i in range(12)]


def test_unknown_inner_dimensions_and_rank_are_split_too():
    ragged_inner = tf.data.Dataset.range(2).map(lambda i: tf.zeros([4, i + 1]))
    sliced = tf_shares.replica_slices(ragged_inner, 2)
    assert sliced.element_spec.shape.as_list() == [2, None]
    assert [t.shape for t in sliced.as_numpy_iterator()] == [(2, 1), (2, 1), (2, 2), (2, 2)]
    unknown_rank = tf.data.Dataset.range(1).map(
        lambda i: tf.io.parse_tensor(tf.io.serialize_tensor(tf.zeros([4, 5])), tf.float32)
    )
    assert unknown_rank.element_spec.shape.rank is None
    shapes = [t.shape for t in tf_shares.replica_slices(unknown_rank, 4).as_numpy_iterator()]
    assert shapes == [(1, 5)] * 4


def test_one_part_is_the_data_set_itself():
    dataset = _batches()
    assert tf_shares.replica_slices(dataset, 1) is dataset


def test_distributed_slices_match_experimental_distribute_dataset():
    devices = tf.config.list_logical_devices("CPU")
    if len(devices) < 4:
        pytest.skip("needs 4 logical CPU devices (KERAS_ACCEL_TEST_DEVICES)")
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices[:4]])
    sliced = tf_shares.replica_slices(_batches(), 4)
    ours = strategy.distribute_datasets_from_function(lambda context: sliced)
    theirs = strategy.experimental_distribute_dataset(_batches())
    for mine, keras_s in zip(ours, theirs, strict=True):
        for a, b in zip(tf.nest.flatten(mine), tf.nest.flatten(keras_s), strict=True):
            local_a = strategy.experimental_local_results(a)
            local_b = strategy.experimental_local_results(b)
            for replica, (x, y) in enumerate(zip(local_a, local_b, strict=True)):
                np.testing.assert_array_equal(x.numpy(), y.numpy(), err_msg=f"replica {replica}")
                assert x.device == y.device
