"""Which Grain data sets several processes can share by rows (`grain.shared_static_rows`), and
what each then reads (`grain.process_share`): its own block of every batch, nothing else.
One process plays each position here; the two-process run is in tests/distributed."""

import itertools

import numpy as np
import pytest

grain = pytest.importorskip("grain")

from keras_accel.data import grain as shares  # noqa: E402

REPLICAS = 4  # Two processes of two devices each.


class Counted:
    """A random-access source of rows `(x, y)` (x = [i, i], y = i) that records each row read."""

    def __init__(self, rows):
        self.rows = rows
        self.read = []

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        self.read.append(int(i))
        return np.float32([i, i]), np.int32(i)


def _share(dataset, position, remainder="pad", processes=2):
    assert shares.shared_static_rows(dataset, processes, REPLICAS, remainder) is not None
    return shares.process_share(dataset, processes, position, REPLICAS, remainder, True)


def _real_rows(batches):
    """The `y` of every real row, batch by batch."""
    return [[int(v) for v, m in zip(y, mask, strict=True) if m] for _, y, _, mask in batches]


def _side_by_side(dataset, remainder="pad", processes=2):
    """Each step's global batch as the processes' blocks make it, and the shares."""
    got = [_share(dataset, p, remainder, processes) for p in range(processes)]
    steps = zip(*(_real_rows(own.own_files.batches()) for own in got), strict=True)
    return [sum(blocks, []) for blocks in steps], got


@pytest.mark.parametrize("rows", [21, 18, 24])
def test_the_blocks_side_by_side_are_one_process_batches_in_order(rows):
    source = Counted(rows)
    dataset = grain.MapDataset.source(source).batch(8)
    steps, got = _side_by_side(dataset)
    assert steps == [list(range(i, min(i + 8, rows))) for i in range(0, rows, 8)]
    for position, own in enumerate(got):
        assert own.plan.batch_size == 8 and own.plan.static_rows == 8
        assert own.plan.num_batches == len(dataset) == own.own_files.plan.num_batches
        assert own.own_files.plan.batch_size == 4 and own.own_files.plan.static_rows == 4
        x, y, _, mask = own.first_batch()
        assert x.shape == (4, 2) and list(y) == [4 * position + i for i in range(4)]
    # 18 rows: the last batch's 2 rows are both process 0's; process 1 feeds padding there.
    last = [list(m) for *_, m in got[1].own_files.batches()][-1]
    assert last == ([0.0] * 4 if rows == 18 else [1.0] + [0.0] * 3 if rows == 21 else [1.0] * 4)


def test_each_process_reads_only_its_rows():
    for position in range(2):
        source = Counted(21)
        dataset = grain.MapDataset.source(source).map(lambda r: r).batch(8)
        own = _share(dataset, position)
        list(own.own_files.batches())
        mine = {i for i in range(21) if (i % 8) // 4 == position}
        assert set(source.read) == mine, (position, sorted(source.read))
        assert len(source.read) == len(mine)  # Each once: the first batch is kept and served.


def test_a_shuffled_source_shares_the_same_permutation():
    dataset = grain.MapDataset.source(Counted(20)).shuffle(seed=3).batch(8)
    steps, _ = _side_by_side(dataset)
    one = [[int(y) for y in batch[1]] for batch in dataset]
    assert steps == one


def test_drop_remainder_keeps_whole_batches_only():
    dataset = grain.MapDataset.source(Counted(21)).batch(8, drop_remainder=True)
    steps, got = _side_by_side(dataset)
    assert steps == [list(range(8)), list(range(8, 16))]
    assert got[0].plan.num_batches == 2
    # The Accelerator's own remainder="drop" (training): the same two batches, no length.
    steps, got = _side_by_side(grain.MapDataset.source(Counted(21)).batch(8), remainder="drop")
    assert steps == [list(range(8)), list(range(8, 16))]
    assert got[0].plan.num_batches is None


def test_an_iter_dataset_of_a_batched_map_dataset_is_shared_with_its_read_options():
    options = grain.ReadOptions(num_threads=2, prefetch_buffer_size=4)
    dataset = grain.MapDataset.source(Counted(21)).batch(8).to_iter_dataset(options)
    steps, got = _side_by_side(dataset)
    assert steps == [list(range(0, 8)), list(range(8, 16)), list(range(16, 21))]
    assert got[0].plan.num_batches is None  # As one process reads an IterDataset.
    # Every process runs as many steps: the share pads to the length of the MapDataset.
    assert [len(list(own.own_files.batches())) for own in got] == [3, 3]


def test_a_repeated_data_set_streams_its_blocks():
    dataset = grain.MapDataset.source(Counted(10)).repeat().batch(4)
    got = [_share(dataset, p) for p in range(2)]
    firsts = [list(itertools.islice(own.own_files.batches(), 3)) for own in got]
    steps = [a + b for a, b in zip(*(_real_rows(f) for f in firsts), strict=True)]
    assert steps == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1]]


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: grain.MapDataset.source(Counted(21)).batch(7), "batch not a multiple"),
        (lambda: grain.MapDataset.source(Counted(21)).batch(8).map(lambda b: b), "map after"),
        (lambda: grain.MapDataset.source(Counted(6)).batch(8), "less than one batch"),
        (lambda: grain.MapDataset.source(Counted(21)), "unbatched"),
        (
            lambda: grain.MapDataset.source(Counted(21)).to_iter_dataset().batch(8),
            "batched after to_iter_dataset",
        ),
    ],
)
def test_what_cannot_be_shared_is_read_whole(make, why):
    assert shares.shared_static_rows(make(), 2, REPLICAS, "pad") is None, why


def test_a_replica_count_that_does_not_split_over_the_processes_is_read_whole():
    dataset = grain.MapDataset.source(Counted(21)).batch(8)
    assert shares.shared_static_rows(dataset, 3, REPLICAS, "pad") is None
    assert shares.shared_static_rows(dataset, 2, REPLICAS, "pad") == 8
