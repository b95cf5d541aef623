"""Arrays on disk (`keras_accel.data.on_disk`): a memory map and an array-like give the
batches that the same arrays in memory give, shuffled or not, weighted, class-weighted, a
process's share of each batch and JAX's groups, and an array-like is read a batch of rows
at a time, never whole."""

import numpy as np
import pytest

from keras_accel.data import on_disk
from keras_accel.data.array_batches import ArrayBatches
from keras_accel.data.batching import element
from keras_accel.data.inputs import to_numpy
from keras_accel.data.pydataset import StaticBatchDataset

pytestmark = pytest.mark.torch  # numpy only: every lane.

ROWS, BATCH = 83, 8  # 11 batches, the last of 3 real rows.


class CountingRows:
    """An array-like over `array` that records the rows of every read and refuses to be
    converted whole (`__array__`), as a test of what reads it."""

    def __init__(self, array):
        self.array = array
        self.shape, self.dtype = array.shape, array.dtype
        self.reads: list[int] = []

    def __len__(self):
        return len(self.array)

    def __getitem__(self, key):
        rows = np.asarray(self.array[key])
        self.reads.append(rows.shape[0] if rows.ndim == self.array.ndim else 1)
        return rows

    def __array__(self, dtype=None, copy=None):
        raise AssertionError(f"an array-like of {len(self)} rows was converted whole")


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    x = {"a": rng.normal(size=(ROWS, 3)).astype("float32"), "b": np.arange(ROWS, dtype="int32")}
    y = rng.integers(0, 4, ROWS)
    weights = rng.random(ROWS).astype("float32")
    return x, y, weights


def _memmaps(tmp_path, arrays):
    """Read-only memory maps holding `arrays` (a structure of them)."""
    made = {}

    def one(name, a):
        path = tmp_path / f"{name}.dat"
        written = np.memmap(path, a.dtype, "w+", shape=a.shape)
        written[:] = a
        written.flush()
        made[name] = np.memmap(path, a.dtype, "r", shape=a.shape)
        return made[name]

    x, y, weights = arrays
    return {k: one(k, v) for k, v in x.items()}, one("y", y), one("w", weights)


def _counting(arrays):
    x, y, weights = arrays
    return {k: CountingRows(v) for k, v in x.items()}, CountingRows(y), CountingRows(weights)


def _assert_same(got, want):
    got, want = element(got, True, None), element(want, True, None)
    leaves = lambda b: [a for a in _flat(b) if a is not None]  # noqa: E731
    for g, w in zip(leaves(got), leaves(want), strict=True):
        assert type(g) is np.ndarray
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def _flat(structure):
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure) for leaf in _flat(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in _flat(item)]
    return [structure]


@pytest.mark.parametrize("where", ["memmap", "array-like"])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("weights", ["sample", "class", None])
def test_batches_on_disk_are_those_of_the_arrays_in_memory(tmp_path, where, shuffle, weights):
    arrays = _arrays()
    disk = _memmaps(tmp_path, arrays) if where == "memmap" else _counting(arrays)
    options = {"batch_size": BATCH, "num_replicas": 1, "shuffle": shuffle, "seed": 3}
    if weights == "class":
        options["class_weight"] = {1: 3.0, 2: 0.5}

    def make(x, y, w):
        return ArrayBatches(x, y, w if weights == "sample" else None, **options)

    memory, batches = make(*arrays), make(*disk)
    assert batches.on_disk and not memory.on_disk
    for epoch in (0, 2):
        memory.epoch = batches.epoch = epoch
        for index in range(len(batches)):
            _assert_same(batches.batch(index), memory.batch(index))
            _assert_same(batches.batch(index, scale=True), memory.batch(index, scale=True))
        # JAX's groups (`ArrayBatches.group`): full ones, and the last with its padded batch.
        for first, count in ((0, 4), (8, 3)):
            _assert_same(batches.group(first, count), memory.group(first, count))
    if where == "array-like":
        reads = [n for leaf in _flat(disk) for n in leaf.reads]
        assert max(reads) <= 4 * BATCH  # A group at most: never the 83 rows.


def test_an_array_like_is_read_a_batch_at_a_time_and_its_last_batch_from_its_rows():
    x, y, weights = (CountingRows(a) for a in (_arrays()[0]["a"], *_arrays()[1:]))
    batches = ArrayBatches(x, y, weights, batch_size=BATCH, num_replicas=4, shuffle=True, seed=0)
    for index in range(len(batches)):
        x.reads.clear()
        batches.batch(index)
        assert x.reads == [batches.plan.rows_in_batch(index)]  # 8 rows, the last 3: one read.


@pytest.mark.parametrize("rows", [slice(0, 4), slice(4, 8)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_process_reads_only_its_rows_of_each_batch(rows, shuffle):
    arrays = _arrays()
    disk = _counting(arrays)
    options = {"batch_size": 6, "num_replicas": 8, "shuffle": shuffle, "seed": 1}
    # 6 real rows padded to 8; the last batch has 5: rows 4 to 7 hold 1 real row, then 2.
    memory, batches = ArrayBatches(*arrays, **options), ArrayBatches(*disk, **options)
    full = StaticBatchDataset(memory, rows=None)
    share = StaticBatchDataset(batches, rows=rows)
    for index in range(len(batches)):
        want = [np.asarray(a)[rows] for a in _flat(full[index])]
        got = _flat(share[index])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
    reads = [n for leaf in _flat(disk) for n in leaf.reads]
    assert max(reads) <= 4  # This process's 4 rows of each batch, never the batch's 8.


def test_on_disk_tells_memory_maps_and_array_likes_from_arrays_in_memory(tmp_path):
    array = np.arange(12.0).reshape(6, 2)
    mapped = _memmaps(tmp_path, ({"a": array}, array[:, 0], array[:, 1]))[0]["a"]
    assert on_disk.on_disk(mapped) and on_disk.on_disk(mapped[2:4])
    assert on_disk.on_disk(np.asarray(mapped))  # A plain view of a memory map.
    assert not on_disk.on_disk(np.take(mapped, [0, 1], axis=0))  # Its own memory.
    assert not on_disk.on_disk(array) and not on_disk.on_disk(array[1:])
    assert on_disk.on_disk(CountingRows(array))
    assert to_numpy(CountingRows(array), "x").__class__ is CountingRows  # Not read whole.
    assert not on_disk.is_array_like([1, 2]) and not on_disk.is_array_like(np.float32(1))


def test_rows_come_back_in_the_order_asked_from_an_array_like_that_wants_them_increasing():
    class Increasing(CountingRows):
        def __getitem__(self, key):
            if not isinstance(key, slice) and np.any(np.diff(np.asarray(key)) <= 0):
                raise TypeError("Indexing elements must be in increasing order")  # h5py's
            return super().__getitem__(key)

    array = np.arange(40.0).reshape(20, 2)
    positions = np.array([7, 2, 19, 0, 11])
    np.testing.assert_array_equal(on_disk.read_rows(Increasing(array), positions), array[positions])


def test_an_array_like_without_index_arrays_is_read_row_by_row_and_a_bad_one_named():
    class RowsOnly:
        shape, dtype = (5, 2), np.dtype("float32")

        def __len__(self):
            return 5

        def __getitem__(self, key):
            if not isinstance(key, (int, slice)):
                raise TypeError("only integers and slices")
            return np.arange(10, dtype="float32").reshape(5, 2)[key]

    np.testing.assert_array_equal(on_disk.read_rows(RowsOnly(), np.array([3, 1])), [[6, 7], [2, 3]])

    class Broken(RowsOnly):
        def __getitem__(self, key):
            return np.zeros((1, 2), "float32")

    with pytest.raises(ValueError, match=r"rows of shape \(1, 2\) where \(2, 2\) were asked"):
        on_disk.read_rows(Broken(), np.array([3, 1]))

    class NoIndex(RowsOnly):
        def __getitem__(self, key):
            raise KeyError(key)

    with pytest.raises(TypeError, match="reads an array-like input a batch of rows at a time"):
        on_disk.read_rows(NoIndex(), np.array([3, 1]))


def test_an_h5py_dataset_gives_the_batches_of_its_arrays(tmp_path):
    h5py = pytest.importorskip("h5py")
    x, y, _ = _arrays()
    with h5py.File(tmp_path / "data.h5", "w") as file:
        file["x"], file["y"] = x["a"], y
    with h5py.File(tmp_path / "data.h5", "r") as file:
        options = {"batch_size": BATCH, "num_replicas": 2, "shuffle": True, "seed": 4}
        batches = ArrayBatches(file["x"], file["y"], **options)
        memory = ArrayBatches(x["a"], y, **options)
        for index in range(len(batches)):
            _assert_same(batches.batch(index), memory.batch(index))


def test_a_read_only_memory_map_is_mapped_again_copy_on_write(tmp_path):
    """The rows a read-only map's view holds, writable, with a write kept from the file and
    from the map it came from; at an offset in the file, and for a view of rows. Anything
    else, untouched."""
    path = tmp_path / "rows.f32"
    whole = np.arange(500 * 7, dtype="float32").reshape(500, 7)
    whole.tofile(path)
    mapped = np.memmap(path, "float32", "r", offset=3 * 7 * 4, shape=(400, 7))
    view = mapped[123:300]
    writable = on_disk.copy_on_write(view)
    assert writable.flags.writeable and on_disk.on_disk(writable)
    np.testing.assert_array_equal(writable, whole[3 + 123 : 3 + 300])
    writable[0] = -1.0
    assert view[0, 0] == whole[126, 0]
    assert np.fromfile(path, "float32").reshape(500, 7)[126, 0] == whole[126, 0]
    columns = mapped[:, 2:]  # Not contiguous rows: left as it is.
    assert on_disk.copy_on_write(columns) is columns
    for other in (whole, np.memmap(path, "float32", "r+", shape=(500, 7)), CountingRows(whole)):
        assert on_disk.copy_on_write(other) is other
    # ArrayBatches maps its arrays so: the batches, those of the arrays in memory.
    batches = ArrayBatches(mapped, mapped[:, 0], batch_size=BATCH, num_replicas=1, shuffle=True)
    assert batches.x.flags.writeable
    reference = ArrayBatches(
        np.array(mapped), np.array(mapped[:, 0]), batch_size=BATCH, num_replicas=1, shuffle=True,
        seed=batches.seed,
    )  # fmt: skip
    for index in range(len(batches)):
        for got, want in zip(batches.batch(index), reference.batch(index)):
            np.testing.assert_array_equal(got, want)
