"""The private names of Python, torch, TensorFlow, JAX and Grain that keras_accel relies on
(keras_accel/utils/library_internals/): each present in the installed version, and a missing
one is an error that names the library, its version and the name, or the public path its
entry names, never a silent change."""

import dataclasses
import importlib.util
import sys
import threading

import pytest

from keras_accel.utils import library_internals

pytestmark = pytest.mark.torch

INSTALLED = {
    "Python": True,
    "torch": importlib.util.find_spec("torch") is not None,
    "TensorFlow": importlib.util.find_spec("tensorflow") is not None,
    "JAX": importlib.util.find_spec("jax") is not None,
}


@pytest.mark.parametrize("library", sorted(INSTALLED))
def test_every_listed_internal_exists_in_the_installed_version(library):
    if not INSTALLED[library]:
        pytest.skip(f"{library} is not installed")
    library_internals.check(library)


def test_every_entry_says_why_and_what_happens_without_it():
    for internal in library_internals.INTERNALS:
        assert len(internal.why) > 20, internal
        assert internal.library in {*INSTALLED, "Grain"}, internal
        assert internal.fallback is None or len(internal.fallback) > 10, internal


def test_a_missing_internal_names_the_library_and_its_version(monkeypatch):
    missing = library_internals.Internal("Python", "os", "_renamed_in_python_9", "a test")
    monkeypatch.setattr(library_internals, "INTERNALS", [missing])
    with pytest.raises(library_internals.LibraryInternalsError) as caught:
        library_internals.check("Python")
    message = str(caught.value)
    assert "Python internal `_renamed_in_python_9` of os" in message
    assert f"Python {sys.version.split()[0]} does not have" in message
    assert isinstance(caught.value, library_internals.InternalsError)


def test_the_python_accessors():
    frames = library_internals.current_frames()
    assert threading.get_ident() in frames


def test_without_threading_hook_the_exit_function_goes_to_atexit(monkeypatch):
    import atexit

    registered = []
    monkeypatch.delattr(threading, "_register_atexit")
    monkeypatch.setattr(atexit, "register", registered.append)
    library_internals.register_before_thread_pools_shutdown(print)
    assert registered == [print]


def test_the_torch_version_counter_counts_in_place_changes():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(2)
    before = library_internals.tensor_version(tensor)
    tensor.add_(1)
    assert library_internals.tensor_version(tensor) > before


def test_a_tensor_without_a_version_counter_names_torch():
    with pytest.raises(library_internals.LibraryInternalsError, match="torch internal `_version`"):
        library_internals.tensor_version(object())


def test_a_missing_tensorflow_internal_names_the_tensorflow_version(monkeypatch):
    tf = pytest.importorskip("tensorflow")
    from tensorflow.python.data.experimental.ops import distribute

    assert library_internals.tf_auto_shard_dataset() is distribute._AutoShardDataset
    monkeypatch.delattr(distribute, "_AutoShardDataset")
    with pytest.raises(library_internals.LibraryInternalsError) as caught:
        library_internals.tf_auto_shard_dataset()
    assert "TensorFlow internal `_AutoShardDataset`" in str(caught.value)
    assert f"TensorFlow {tf.__version__}" in str(caught.value)


def test_device_datasets_are_restored_and_left_alone_where_missing(monkeypatch):
    pytest.importorskip("tensorflow")
    from tensorflow.python.data.ops import multi_device_iterator_ops as module

    original = module._create_device_dataset
    with library_internals.tf_device_datasets_without_autotune():
        assert module._create_device_dataset is not original
    assert module._create_device_dataset is original
    monkeypatch.delattr(module, "_create_device_dataset")
    with library_internals.tf_device_datasets_without_autotune():
        assert not hasattr(module, "_create_device_dataset")


def test_a_distributed_iterator_made_when_read_is_made_at_its_first_read(backend, monkeypatch):
    if backend != "tensorflow":
        pytest.skip("tf.distribute iterators, over the TensorFlow run's devices: that run has it")
    import tensorflow as tf

    from keras_accel.utils.library_internals import tensorflow_ops

    strategy = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:2])
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
    made = []

    def make():
        made.append(iter(dataset))
        return made[-1]

    kind = type(iter(dataset))
    first, second = (library_internals.tf_iterator_made_when_read(make, kind) for _ in "ab")
    assert not made  # Asked for, not read: nothing made.
    assert isinstance(first, tf.distribute.DistributedIterator)  # What Keras's step tests.

    @tf.function
    def read(iterator):
        return strategy.gather(next(iterator), axis=0)

    assert read(first).numpy().tolist() == [0, 1, 2, 3] and len(made) == 1
    assert read(first).numpy().tolist() == [4, 5, 6, 7] and len(made) == 1  # It goes on.
    assert read(second).numpy().tolist() == [0, 1, 2, 3] and len(made) == 2
    assert read.experimental_get_tracing_count() == 1  # One signature: the real one's.
    # Any other class, or a TensorFlow without this one, is made at once.
    library_internals.tf_iterator_made_when_read(make, object)
    assert len(made) == 3
    missing = dataclasses.replace(tensorflow_ops._DISTRIBUTED_ITERATOR, name="Renamed")
    monkeypatch.setattr(tensorflow_ops, "_DISTRIBUTED_ITERATOR", missing)
    library_internals.tf_iterator_made_when_read(make, kind)
    assert len(made) == 4


def test_whether_replicas_merge_to_reduce_is_read_from_the_current_strategy(backend, monkeypatch):
    if backend != "tensorflow":
        pytest.skip("tf.distribute strategies over the TensorFlow run's devices: that run has it")
    import tensorflow as tf

    from keras_accel.utils.library_internals import tensorflow_ops

    strategy = tf.distribute.MirroredStrategy(tf.config.list_logical_devices("CPU")[:2])
    assert not library_internals.tf_replicas_merge_to_reduce()  # No strategy: no replicas.
    with strategy.scope():
        assert library_internals.tf_replicas_merge_to_reduce()  # On CPUs, always.
        missing = dataclasses.replace(tensorflow_ops._SUPPORTS_NO_MERGE_CALL, name="Renamed")
        monkeypatch.setattr(tensorflow_ops, "_SUPPORTS_NO_MERGE_CALL", missing)
        tensorflow_ops._supports_no_merge_call.cache_clear()  # Looked up once a process.
        try:
            assert not library_internals.tf_replicas_merge_to_reduce()  # Unknown: all_reduce.
        finally:
            monkeypatch.undo()
            tensorflow_ops._supports_no_merge_call.cache_clear()
        assert library_internals.tf_replicas_merge_to_reduce()


def test_grain_batching_reads_a_batched_data_set():
    grain = pytest.importorskip("grain")
    batched = grain.MapDataset.range(10).batch(4, drop_remainder=True)
    batching = library_internals.grain_batching(batched)
    assert (batching.batch_size, batching.drop_remainder) == (4, True)
    assert batching.read_options is None
    assert library_internals.grain_batching(grain.MapDataset.range(10)) is None


def test_keras_internals_errors_share_the_base():
    from keras_accel.utils import keras_internals

    assert issubclass(keras_internals.KerasInternalsError, library_internals.InternalsError)
