"""DCP's `.metadata` read through the allow-list unpickler (keras_accel.state.engines.
dcp_metadata): a real index reads back as DCP's own `pickle.load` reads it; every way a
planted index could run code or read outside its step is refused, naming the file and what
it asked for, and nothing of it runs."""

import copyreg
import os
import pickle

import keras
import numpy as np
import pytest

from keras_accel.state import checksums

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(keras.backend.backend() != "torch", reason="the torch engine"),
]


class _Call:
    def __init__(self, function, *args):
        self.call = (function, args)

    def __reduce__(self):
        return self.call


@pytest.fixture
def step(tmp_path):
    """(engine, step path, variables, manifest) of one committed DCP step."""
    from keras_accel.state import tree
    from keras_accel.state.engines import torch_dcp

    keras.backend.clear_session(free_memory=False)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.Adam(0.01), "mse")
    model.optimizer.build(model.trainable_variables)
    state = tree.variables(model)
    engine = torch_dcp.Engine(str(tmp_path / "backup"), 3, asynchronous=False)
    engine.save(1, state, {"format": "test"})
    return engine, engine.path(1), state, tree.manifest(state)


def _trusted(path):
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # Written by this test's own save.


def _plant(path, index):
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(index, f)


def test_a_real_index_reads_back_whole(step):
    from keras_accel.state.engines import dcp_metadata

    engine, path, state, manifest = step
    assert dcp_metadata.read(path) == _trusted(path)
    assert engine.verify(1) is True
    engine.restore(1, state, manifest)


def test_every_way_a_planted_index_could_run_code_or_read_elsewhere_is_refused(step, tmp_path):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    from keras_accel.state.engines import dcp_metadata

    engine, path, state, manifest = step
    marker = str(tmp_path / "ran")
    with open(os.path.join(path, ".metadata"), "rb") as f:
        original = f.read()
    index = _trusted(path)
    key = sorted(index.state_dict_metadata)[0]
    info = next(v for k, v in index.storage_data.items() if k.fqn == key)

    def refused(match):
        with pytest.raises(dcp_metadata.Refused, match=match) as caught:
            engine.verify(1)
        assert str(caught.value).startswith(".metadata: ")
        with pytest.raises(dcp_metadata.Refused, match=match):
            engine.restore(1, state, manifest)
        assert not os.path.exists(marker)

    # 1. A value stored as bytes: DCP reads it back with torch.load(weights_only=False),
    # and here the bytes are a legacy torch file whose first pickle runs a command.
    with open(os.path.join(path, "__9_0.distcp"), "wb") as f:
        f.write(pickle.dumps(_Call(os.system, f"touch {marker}")))
    index.state_dict_metadata[key] = BytesStorageMetadata()
    index.storage_data = {k: v for k, v in index.storage_data.items() if k.fqn != key}
    size = os.path.getsize(os.path.join(path, "__9_0.distcp"))
    index.storage_data[MetadataIndex(key)] = type(info)("__9_0.distcp", 0, size)
    _plant(path, index)
    refused(r"BytesStorageMetadata.*torch\.load\(weights_only=False\)")

    # 2. An index that points DCP at a file outside the step.
    index = pickle.loads(original)  # This test's own save.
    first = next(iter(index.storage_data))
    index.storage_data[first] = type(info)("../../outside.distcp", 0, 8)
    _plant(path, index)
    refused(r"points at '\.\./\.\./outside\.distcp', not at a file of the step")

    # 3. A global reached through an extension code some library of the process
    # registered with copyreg, not by its name.
    copyreg.add_extension(os.system.__module__, "system", 0x7A5F)
    try:
        planted = pickle.dumps(_Call(os.system, f"touch {marker}"), protocol=2)
        assert planted.startswith(b"\x80\x02\x83")  # EXT2: the code, not the name.
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(planted)
        refused(rf"loads the global {os.system.__module__}\.system, ")
    finally:
        copyreg.remove_extension(os.system.__module__, "system", 0x7A5F)

    # 4. A persistent id, which DCP never writes.
    class Persistent(pickle.Pickler):
        def persistent_id(self, obj):
            return "x" if obj == "here" else None

    with open(os.path.join(path, ".metadata"), "wb") as f:
        Persistent(f).dump(["here"])
    refused("persistent id")

    # 5. Not an index at all, though made of allowed values.
    _plant(path, {"version": "1.0.0"})
    refused("its pickle is a dict, not DCP's Metadata")

    # A file cut short is damage, not an attack: named as such.
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(original[: len(original) // 2])
    with pytest.raises(checksums.Damaged, match=r"^\.metadata: unreadable \(") as caught:
        engine.verify(1)
    assert not isinstance(caught.value, dcp_metadata.Refused)

    # The original restores again: nothing was left behind.
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(original)
    engine.restore(1, state, manifest)
    assert all(np.isfinite(np.asarray(v.numpy())).all() for v in state.values())
