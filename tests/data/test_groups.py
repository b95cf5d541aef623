"""Batches a group at a time (`keras_accel.data.groups`, what `acc.fit` feeds its grouped JAX
steps from arrays on one CPU device): each group is the same arrays as its batches stacked,
and training on them gives the weights that batches fed one by one give, bit for bit."""

import keras
import numpy as np
import pytest

from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import element
from keras_accel.data.groups import ArrayGroupPasses, StackedGroup
from tests.conftest import BACKEND


def _stack(batches):
    return [np.stack(leaves) for leaves in zip(*(_leaves(b) for b in batches))]


def _leaves(structure):
    return [leaf for leaf in keras.tree.flatten(structure) if leaf is not None]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("weighted", [True, False])
def test_a_group_is_its_batches_stacked(shuffle, weighted):
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(83, 3)).astype("float32"), "b": np.arange(83, dtype="int32")}
    y = rng.integers(0, 4, 83)
    weights = rng.random(83) if weighted else None
    batches = ArrayBatches(x, y, weights, batch_size=8, num_replicas=1, shuffle=shuffle, seed=5)
    batches.epoch = 3
    passes = ArrayGroupPasses(batches, steps=4)
    groups = list(passes.get_jax_iterator())
    assert [g.count for g in groups] == [4, 4, 3]  # 11 batches, the last of 3 rows padded.
    for number, group in enumerate(groups):
        assert isinstance(group, StackedGroup)
        first = 4 * number
        want = [element(batches.batch(i), True, None, 8) for i in range(first, first + group.count)]
        got = _leaves(group.batches)
        assert [a.dtype for a in got] == [a.dtype for a in _leaves(want[0])]
        for got_leaf, want_leaf in zip(got, _stack(want)):
            np.testing.assert_array_equal(got_leaf, want_leaf)


@pytest.mark.skipif(
    BACKEND != "jax",
    reason="JAX's grouped steps (TensorFlow's: tests/adapter/test_tf_speed_xla_groups.py)",
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_training_on_groups_gives_the_weights_of_batches_one_by_one(monkeypatch):
    from keras_accel import Accelerator
    from keras_accel.adapter.backends import jax_groups
    from keras_accel.adapter.backends.jax import Runtime
    from keras_accel.utils import keras_internals

    rng = np.random.default_rng(1)
    x = rng.normal(size=(203, 6)).astype("float32")
    y = rng.integers(0, 3, 203)
    weights = rng.random(203).astype("float32")

    def train(grouped: bool):
        seen, gathered = [], []  # What the grouped calls read; the groups gathered at once.
        call, group = jax_groups.GroupedSteps.__call__, ArrayBatches.group

        def spy(self, state, iterator):
            wrapped = _Peek(iterator, seen)
            return call(self, state, wrapped)

        def spy_group(self, first, count):
            gathered.append(count)
            return group(self, first, count)

        monkeypatch.setattr(jax_groups.GroupedSteps, "__call__", spy)
        monkeypatch.setattr(ArrayBatches, "group", spy_group)
        if not grouped:
            monkeypatch.setattr(Runtime, "grouped", lambda *args, **kwargs: None)
        keras.utils.set_random_seed(0)
        acc = Accelerator(seed=0, devices=1, steps_per_execution=4)
        with acc.scope():
            model = keras.Sequential(
                [
                    keras.Input((6,)),
                    keras.layers.Dense(8, activation="relu"),
                    keras.layers.Dropout(0.2),
                    keras.layers.Dense(3),
                ]
            )
            model.compile(
                keras.optimizers.Adam(1e-2),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        history = acc.fit(
            model,
            x,
            y,
            batch_size=16,
            epochs=3,
            initial_epoch=1,
            sample_weight=weights,
            validation_data=(x[:50], y[:50]),
            verbose=0,
        )
        evaluation = acc.evaluate(model, x, y, batch_size=16, verbose=0)
        monkeypatch.undo()
        return [w.numpy() for w in model.weights], history.history, evaluation, seen, gathered

    weights_g, history_g, evaluation_g, seen_g, gathered_g = train(grouped=True)
    weights_1, history_1, evaluation_1, seen_1, gathered_1 = train(grouped=False)
    # Every grouped call read one group gathered at once: ours; on Keras 3.16 in its own
    # form, its epoch iterator reading one more than the calls take at some epoch's end.
    assert gathered_g
    if keras_internals.keras_scans_steps():
        assert len(gathered_g) >= len(seen_g)
    else:
        assert len(gathered_g) == len(seen_g)
        assert all(isinstance(item, StackedGroup) for item in seen_g)
    assert seen_1 and not gathered_1
    assert history_g == history_1
    assert evaluation_g == evaluation_1
    for got, want in zip(weights_g, weights_1):
        np.testing.assert_array_equal(got, want)


class _Peek:
    """An iterator that records what it gives."""

    def __init__(self, iterator, seen):
        self.iterator, self.seen = iterator, seen

    def __iter__(self):
        return self

    def __next__(self):
        item = next(self.iterator)
        self.seen.append(item)
        return item
