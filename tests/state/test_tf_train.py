"""The tf.train engine's saves that a kill interrupted, wherever TensorFlow was in writing them."""

import os

import keras
import pytest

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "tensorflow", reason="the tf.train engine"
)


def _state():
    from keras_accel.state import tree

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse")
    model.optimizer.build(model.trainable_variables)
    return tree.variables(model)


def test_a_save_killed_while_merging_its_shards_is_named_and_removed(tmp_path):
    """TensorFlow writes a checkpoint's shards in `ckpt-N_temp/`, merges them into
    `ckpt-N.data-*`, then writes `ckpt-N.index`: killed between the two, the data has no
    index (on object stores, where the merge is a copy, a wider window)."""
    from keras_accel.state.engines import tf_train

    engine = tf_train.Engine(str(tmp_path), 3, asynchronous=False)
    state = _state()
    for step in (2, 4):
        engine.save(step, state, {"step": step})
    engine.close()
    os.remove(tmp_path / "ckpt-4.index")
    (tmp_path / "ckpt-6_temp").mkdir()  # Killed before the merge.
    (tmp_path / "ckpt-6_temp" / "part-00000-of-00001.data-00000-of-00001").write_bytes(b"x")

    reopened = tf_train.Engine(str(tmp_path), 3, asynchronous=False)
    assert reopened.interrupted == [4, 6]
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "ckpt-2.data-00000-of-00001",
        "ckpt-2.index",
    ]
    assert reopened.steps() == [2]
    assert reopened.read_meta(2) == {"step": 2}
    reopened.close()
