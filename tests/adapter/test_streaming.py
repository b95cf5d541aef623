"""Streamed inputs (never counted before training): tf.data pipelines of every length, a
TFRecord set read from files, Python generators, PyDatasets without a length or shuffled.

Each is compared against plain single-device Keras on the same data (a "twin" with the
same initial weights): losses per epoch, weights after fit, evaluate and predict. With 8
replicas (2 on TensorFlow), batches of 16 rows over 43 rows leave a last batch of 11 real
rows, padded.

TensorFlow traces every step program under an 8-replica MirroredStrategy for many seconds
(a fused one longer still), so the tests keep their Accelerator calls few, and the ones
whose point is not host-loop fusion run one step per call (`ONE_STEP`).
"""

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from tests.helpers import FEW_REPLICAS, assert_weights_close, compiled_mlp, data

ROWS, BATCH = 43, 16  # 3 batches a pass, the last with 11 real rows.
X, Y = data(ROWS)


@pytest.fixture(scope="module")
def tf():
    return pytest.importorskip("tensorflow")


ONE_STEP = {"steps_per_execution": 1}

# TensorFlow traces every step once per replica: two replicas take every cross-replica
# path (`FEW_REPLICAS`); JAX's one program runs on every device.
DEVICES = {"devices": FEW_REPLICAS} if keras.backend.backend() == "tensorflow" else {}


def _pair(acc, **kwargs):
    with acc.scope():
        model = compiled_mlp(**kwargs)
    twin = compiled_mlp(**kwargs)
    twin.set_weights(model.get_weights())
    return model, twin


def _losses_close(got, want, rtol=1e-5):
    for key in ("loss", "val_loss"):
        if key in want.history:
            np.testing.assert_allclose(got.history[key], want.history[key], rtol=rtol, err_msg=key)


def _evaluate_close(acc, model, twin, data_for_acc, rtol=1e-5):
    got = acc.evaluate(model, data_for_acc, verbose=0)
    want = twin.evaluate(X, Y, batch_size=ROWS, verbose=0)  # One batch: the exact mean.
    np.testing.assert_allclose(got, want, rtol=rtol)


def _slices(x, y=None, size=BATCH, passes=1):
    """A generator over one or more passes of (x, y) (or x) batches."""
    for _ in range(passes):
        for start in range(0, len(x), size):
            part = slice(start, start + size)
            yield x[part] if y is None else (x[part], y[part])


def _endless(x, y, size=BATCH):
    while True:
        yield from _slices(x, y, size)


# ------------------------------------------------------------------ tf.data


def test_tf_data_with_partial_last_batch_over_two_epochs(tf):
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    got = acc.fit(model, dataset, epochs=2, verbose=0)
    want = twin.fit(dataset, epochs=2, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())
    _evaluate_close(acc, model, twin, dataset)
    predictions = acc.predict(model, dataset.map(lambda x, y: x), verbose=0)
    np.testing.assert_allclose(predictions, np.asarray(twin(X)), atol=1e-5)


def test_tf_data_of_unknown_cardinality(tf):
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    # 0 and 2 labels only: the filter leaves a number of rows tf.data cannot know.
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: y != 1).batch(BATCH)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    kept = Y != 1
    got = acc.fit(model, dataset, epochs=2, verbose=0)
    want = twin.fit(dataset, epochs=2, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())
    np.testing.assert_allclose(
        acc.evaluate(model, dataset, verbose=0),
        twin.evaluate(X[kept], Y[kept], batch_size=ROWS, verbose=0),
        rtol=1e-5,
    )
    predictions = acc.predict(model, dataset.map(lambda x, y: x), verbose=0)
    assert predictions.shape == (int(kept.sum()), 3)
    np.testing.assert_allclose(predictions, np.asarray(twin(X[kept])), atol=1e-5)


def test_infinite_tf_data_with_steps_per_epoch(tf):
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    # 5 steps an epoch over 3 batches a pass: epochs start mid-pass, partial batch included.
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH).repeat()
    got = acc.fit(model, dataset, epochs=2, steps_per_epoch=5, verbose=0)
    want = twin.fit(dataset, epochs=2, steps_per_epoch=5, verbose=0)
    assert len(got.history["loss"]) == 2
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())
    assert acc.evaluate(model, dataset, steps=3, verbose=0) == pytest.approx(
        twin.evaluate(X, Y, batch_size=ROWS, verbose=0), rel=1e-5
    )


def test_tf_data_with_drop_remainder_is_not_padded(tf):
    acc = Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc)
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH, drop_remainder=True)
    got = acc.fit(model, dataset, epochs=2, verbose=0)
    want = twin.fit(dataset, epochs=2, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_unbatched_then_mapped_and_batched_tf_data(tf):
    acc = Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc)
    # Rows made in the pipeline: x scaled, y computed from x, then batched.
    dataset = (
        tf.data.Dataset.from_tensor_slices(X)
        .map(lambda x: (2.0 * x, tf.cast(x[0] > 0, tf.int64)))
        .batch(BATCH)
    )
    got = acc.fit(model, dataset, epochs=1, verbose=0)
    want = twin.fit(dataset, epochs=1, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


@pytest.mark.parametrize(
    "fused",
    [
        False,
        pytest.param(
            True,
            marks=[
                # Seen on both backends; a fused trace costs TensorFlow a minute here.
                pytest.mark.skipif(
                    keras.backend.backend() == "tensorflow", reason="shown on JAX (same cause)"
                ),
            ],
        ),
    ],
    ids=["one_step_per_call", "auto_fusion"],
)
def test_tf_data_validation_with_validation_steps(tf, fused):
    acc = Accelerator(**DEVICES) if fused else Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc)
    train = tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)
    vx, vy = data(40, seed=1)
    # 3 batches (the last of 8 rows); 2 validation steps read the first 32 rows.
    val = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(BATCH)
    got = acc.fit(model, train, epochs=1, validation_data=val, validation_steps=2, verbose=0)
    want = twin.fit(train, epochs=1, validation_data=val, validation_steps=2, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())
    np.testing.assert_allclose(
        got.history["val_loss"][0],
        twin.evaluate(vx[:32], vy[:32], batch_size=32, verbose=0)[0],
        rtol=1e-5,
    )


# ------------------------------------------------------------------ TFRecord files


def _write_shards(tf, directory, x, y, shards):
    files = []
    for shard, rows in enumerate(np.array_split(np.arange(len(x)), shards)):
        path = str(directory / f"part-{shard}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in rows:
                feature = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        files.append(path)
    return files


def test_tfrecord_files_are_streamed_without_a_counting_pass(tf, tmp_path):
    x, y = data(600, seed=2)
    files = _write_shards(tf, tmp_path, x, y, shards=3)
    reads = tf.Variable(0, dtype=tf.int64, trainable=False)
    spec = {
        "x": tf.io.FixedLenFeature([6], tf.float32),
        "y": tf.io.FixedLenFeature([1], tf.int64),
    }

    def parse(record):
        reads.assign_add(1)  # Every record parsed, read back in a callback.
        parsed = tf.io.parse_single_example(record, spec)
        return parsed["x"], parsed["y"][0]

    def dataset():
        return tf.data.TFRecordDataset(files).map(parse).batch(BATCH)

    class ReadsAtFirstStep(keras.callbacks.Callback):
        seen = None

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and self.seen is None:
                type(self).seen = int(reads.numpy())

    acc = Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc, batchnorm=False)
    got = acc.fit(model, dataset(), epochs=1, verbose=0, callbacks=[ReadsAtFirstStep()])
    # A counting pass would have parsed all 600 records before the first step. Read instead:
    # the first batch (twice: its structure, the model's build, each through a prefetching
    # iterator, ~20 records each) and what the prefetch buffers fill (~130 records in all).
    assert ReadsAtFirstStep.seen is not None
    assert ReadsAtFirstStep.seen <= 16 * BATCH < len(x), ReadsAtFirstStep.seen
    assert int(reads.numpy()) >= len(x)
    want = twin.fit(dataset(), epochs=1, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


# ------------------------------------------------------------------ generators


def test_finite_generator_fit_with_steps_evaluate_and_predict_one_pass():
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    # Two passes for two epochs of 3 steps; the last batch of each pass is padded.
    got = acc.fit(model, _slices(X, Y, passes=2), epochs=2, steps_per_epoch=3, verbose=0)
    want = twin.fit(_slices(X, Y, passes=2), epochs=2, steps_per_epoch=3, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())
    _evaluate_close(acc, model, twin, _slices(X, Y))
    predictions = acc.predict(model, _slices(X), verbose=0)
    assert predictions.shape == (ROWS, 3)
    np.testing.assert_allclose(predictions, np.asarray(twin(X)), atol=1e-5)


def test_endless_generator_with_steps_per_epoch():
    acc = Accelerator(**DEVICES)
    model, twin = _pair(acc)
    got = acc.fit(model, _endless(X, Y), epochs=2, steps_per_epoch=4, verbose=0)
    want = twin.fit(_endless(X, Y), epochs=2, steps_per_epoch=4, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


def _aligned(array, alignment=64):
    """A copy of `array` whose rows start at a multiple of `alignment` bytes."""
    raw = np.empty(array.nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    out = raw[start : start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


def test_batches_read_in_python_leave_the_users_arrays_as_they_were():
    # A generator's or a PyDataset's batches here are views of the user's arrays (a full
    # batch needs no padding: 4 rows over FEW_REPLICAS), each 64-byte aligned. On
    # TensorFlow, tf.data makes such a numpy batch a tensor over the array's own memory, and
    # a step's ops may write their results into a tensor that nothing else holds: over 2
    # replicas with fused steps, mean squared error wrote (pred - y)**2 into the rows of y
    # that replica 0 read (4 December 2026), so the next epoch, and plain Keras on the same
    # arrays, read other targets. Where an array lies is up to the allocator: unaligned
    # arrays are copied, hence "about half the runs" before the alignment was pinned here.
    rng = np.random.default_rng(0)
    x0 = rng.normal(size=(12, 4)).astype("float32")
    y0 = rng.normal(size=(12, 4)).astype("float32")
    x, y = _aligned(x0), _aligned(y0)

    def build():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    def generator(passes=1):
        return ((x[i : i + 4], y[i : i + 4]) for _ in range(passes) for i in range(0, 12, 4))

    acc = Accelerator(devices=FEW_REPLICAS, steps_per_execution=3)
    with acc.scope():
        model = build()
    twin = build()
    twin.set_weights(model.get_weights())
    acc.fit(model, generator(passes=2), epochs=2, steps_per_epoch=3, verbose=0)
    twin.fit(x0, y0, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), twin.get_weights())
    want = twin.evaluate(x0, y0, batch_size=12, verbose=0)
    for source in [generator(), Batches(x, y, 4), generator()]:
        np.testing.assert_allclose(acc.evaluate(model, source, verbose=0), want, rtol=1e-5)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(y, y0)


# ------------------------------------------------------------------ PyDataset


class Batches(keras.utils.PyDataset):
    """(x, y) batches, with or without a length; `reads` lists the batch indices read."""

    def __init__(self, x, y, batch_size, length=True):
        super().__init__()
        self.x, self.y, self.batch_size, self.length = x, y, batch_size, length
        self.passes = -(-len(x) // batch_size)
        self.reads = []

    @property
    def num_batches(self):
        return self.passes if self.length else None

    def __len__(self):
        return self.passes

    def __getitem__(self, index):
        self.reads.append(index)
        index %= self.passes  # Without a length: read on for ever, pass after pass.
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


class ReadsPerEpoch(keras.callbacks.Callback):
    """The batch indices a PyDataset served in each epoch (reads before training left out)."""

    def __init__(self, dataset):
        super().__init__()
        self.dataset, self.epochs = dataset, []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = len(self.dataset.reads)

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(self.dataset.reads[self.start :])


def test_pydataset_without_a_length_with_steps_per_epoch():
    acc = Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc)
    got = acc.fit(
        model, Batches(X, Y, BATCH, length=False), epochs=2, steps_per_epoch=5,
        shuffle=False, verbose=0,
    )  # fmt: skip
    want = twin.fit(
        Batches(X, Y, BATCH, length=False), epochs=2, steps_per_epoch=5, shuffle=False, verbose=0
    )
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


def test_pydataset_shuffle_permutes_batches_per_epoch_from_the_seed():
    from keras_accel.data.sources import PyDatasetBatches

    acc = Accelerator(seed=3, **ONE_STEP, **DEVICES)
    with acc.scope():
        model = compiled_mlp(batchnorm=False)
    x, y = data(48)
    dataset = Batches(x, y, 8)  # 6 batches.
    reads = ReadsPerEpoch(dataset)
    acc.fit(model, dataset, epochs=2, shuffle=True, verbose=0, callbacks=[reads])
    orders = reads.epochs
    for order in orders:
        assert sorted(order) == list(range(6)), orders  # Every batch once an epoch.
    assert orders[0] != orders[1], orders

    def planned(seed):  # The orders another run with this seed serves.
        batches = PyDatasetBatches(Batches(x, y, 8), num_replicas=8, shuffle=True, seed=seed)
        out = []
        for epoch in range(2):
            batches.epoch = epoch
            out.append([batches.source_index(i) for i in range(6)])
        return out

    assert Accelerator(seed=3).seed == acc.seed
    assert planned(acc.seed) == orders
    assert planned(4) != orders


def test_pydataset_unshuffled_equals_keras():
    acc = Accelerator(**ONE_STEP, **DEVICES)
    model, twin = _pair(acc)
    got = acc.fit(model, Batches(X, Y, BATCH), epochs=2, shuffle=False, verbose=0)
    want = twin.fit(Batches(X, Y, BATCH), epochs=2, shuffle=False, verbose=0)
    _losses_close(got, want)
    assert_weights_close(model.get_weights(), twin.get_weights())


# ------------------------------------------------------------------ bad inputs


# A batch larger than the first: tests/adapter/test_growing_batches.py.


def test_an_empty_generator_is_a_clear_error():
    acc = Accelerator(**DEVICES)
    model, _ = _pair(acc)
    with pytest.raises(ValueError, match="generator is empty"):
        acc.fit(model, (batch for batch in []), epochs=1, verbose=0)


def test_a_schedule_needing_total_steps_over_an_unknown_length_names_steps_per_epoch():
    from keras_accel.schedules import CosineDecay

    acc = Accelerator(**ONE_STEP, **DEVICES)
    with acc.scope():
        model = compiled_mlp(optimizer=keras.optimizers.SGD(CosineDecay(0.1)))
    with pytest.raises(ValueError, match="steps_per_epoch"):
        acc.fit(model, _slices(X, Y), epochs=1, verbose=0)
    # With steps_per_epoch it trains.
    history = acc.fit(model, _endless(X, Y), epochs=1, steps_per_epoch=3, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_schedule_needing_total_steps_over_unknown_tf_data_names_steps_per_epoch(tf):
    from keras_accel.schedules import CosineDecay

    acc = Accelerator(**DEVICES)
    with acc.scope():
        model = compiled_mlp(optimizer=keras.optimizers.SGD(CosineDecay(0.1)))
    dataset = tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: y >= 0).batch(BATCH)
    with pytest.raises(ValueError, match="steps_per_epoch"):
        acc.fit(model, dataset, epochs=1, verbose=0)


# ------------------------------------------------------------------ custom loop


def _loop_pair(acc):
    keras.backend.clear_session(free_memory=False)
    with acc.scope():
        model = compiled_mlp()
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy")
    twin = compiled_mlp()
    twin.compile(keras.optimizers.SGD(0.1, momentum=0.9), "sparse_categorical_crossentropy")
    twin.set_weights(model.get_weights())
    loop = acc.loop(model, loss=keras.losses.SparseCategoricalCrossentropy())
    return model, twin, loop


def _loop_over(loop, make, epochs=2):
    results = []
    for epoch in range(epochs):
        loop.reset_metrics()
        for batch in loop.batches(make(), epoch=epoch):
            loop.train_step(batch)
        results.append(loop.results()["loss"])
    return results


@pytest.mark.parametrize("kind", ["tf_data", "generator"])
def test_custom_loop_over_streams(kind, tf):
    acc = Accelerator(seed=0, **DEVICES)
    model, twin, loop = _loop_pair(acc)
    if kind == "tf_data":
        make = lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(BATCH)  # noqa: E731
    else:
        make = lambda: _slices(X, Y)  # noqa: E731
    losses = _loop_over(loop, make)
    history = twin.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(losses, history.history["loss"], rtol=1e-5)
    assert_weights_close(model.get_weights(), twin.get_weights())
    got = loop.evaluate(make())["loss"]
    want = twin.evaluate(X, Y, batch_size=ROWS, verbose=0, return_dict=True)["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("kind", ["tf_data", "generator"])
def test_custom_loop_predict_over_streams(kind, tf):
    acc = Accelerator(seed=0, **DEVICES)
    model, twin, loop = _loop_pair(acc)
    stream = tf.data.Dataset.from_tensor_slices(X).batch(BATCH) if kind == "tf_data" else None
    stream = _slices(X) if stream is None else stream
    predictions = loop.predict(stream)
    np.testing.assert_allclose(predictions, np.asarray(twin(X)), atol=1e-5)
