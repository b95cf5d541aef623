"""Which tf.data pipelines each process can read by file (`tf_process_files.process_files`), and
what it then reads: its own files, in its share of each batch. One process plays each index
here; the two-process runs are in tests/distributed."""

import pytest

tf = pytest.importorskip("tensorflow")

from keras_accel.data import tf_process_files  # noqa: E402
from keras_accel.data.tf_datasets import TFDatasetBatches  # noqa: E402
from keras_accel.utils import library_internals  # noqa: E402


def _write(directory, files=3, rows=(5, 7, 9)):
    names = []
    for file in range(files):
        name = str(directory / f"part-{file}.tfrecord")
        with tf.io.TFRecordWriter(name) as writer:
            for row in range(rows[file]):
                writer.write(tf.io.serialize_tensor(tf.constant([file * 100 + row])).numpy())
        names.append(name)
    return names


def _pipeline(names, batch=4, **interleave):
    records = tf.data.Dataset.from_tensor_slices(names).interleave(
        tf.data.TFRecordDataset, cycle_length=1, **interleave
    )
    return records.map(lambda r: tf.io.parse_tensor(r, tf.int32)).batch(batch)


def _batches(dataset, replicas=2):
    return TFDatasetBatches(dataset, num_replicas=replicas, remainder="pad", training=True)


def _real_rows(own):
    """The values of every real (unpadded) row this share reads, batch by batch."""
    rows = []
    for element in own.pipeline():
        x, _, _, mask = tf_process_files._numpy_batch(element)
        rows.append([int(v) for v, m in zip(x.ravel(), mask, strict=True) if m])
    return rows


def test_each_process_reads_its_files_in_its_share_of_each_batch(tmp_path):
    names = _write(tmp_path)
    batches = _batches(_pipeline(names))
    shares = [tf_process_files.process_files(batches, 2, index) for index in range(2)]
    for own in shares:
        assert own is not None
        assert own.plan.batch_size == 2 and own.plan.static_rows == 2
        assert own.plan.num_batches is None  # Each process's count, unknown in advance.
    x, _, _, mask = shares[0].first_batch()
    assert x.shape == (2, 1) and list(mask) == [1, 1]
    read = [sorted({v // 100 for batch in _real_rows(own) for v in batch}) for own in shares]
    assert read == [[0, 2], [1]]  # Files 0 and 2, then file 1: by file, not by rows.


def test_a_short_batch_of_a_process_is_padded_to_its_share(tmp_path):
    names = _write(tmp_path, files=2, rows=(5, 2))
    own = tf_process_files.process_files(_batches(_pipeline(names)), 2, 0)
    sizes = [len(batch) for batch in _real_rows(own)]
    assert own.first_batch()[0].shape == (2, 1)
    assert sizes == [2, 2, 1]  # File 0's 5 rows in shares of 2; the last one padded.


@pytest.mark.parametrize(
    "why",
    ["fewer files than processes", "no files", "batch not a multiple", "empty share", "off"],
)
def test_where_a_process_cannot_have_its_own_files(tmp_path, why, monkeypatch):
    if why == "fewer files than processes":
        dataset, processes = _pipeline(_write(tmp_path, files=1)), 2
    elif why == "no files":
        dataset, processes = tf.data.Dataset.range(20).batch(4), 2
        # Told by its graph, not by tf.data's FILE sharding, which logs an error with the
        # whole graph in every process first ("tf_auto_shard failed", issue 34).
        monkeypatch.setattr(
            library_internals, "tf_auto_shard_dataset", lambda: pytest.fail("tried")
        )
    elif why == "batch not a multiple":
        dataset, processes = _pipeline(_write(tmp_path), batch=6), 4
    elif why == "empty share":
        names = _write(tmp_path, files=2, rows=(5, 0))
        dataset, processes = _pipeline(names), 2
    else:  # The user's own auto-shard policy says OFF: read whole, as it says.
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset, processes = _pipeline(_write(tmp_path)).with_options(options), 2
    batches = _batches(dataset, replicas=processes)
    assert tf_process_files.process_files(batches, processes, processes - 1) is None
