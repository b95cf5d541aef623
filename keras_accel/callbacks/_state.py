"""The full training state as plain data: variables as an .npz, random generators as JSON.

No pickle anywhere: arrays are saved with `allow_pickle=False` and read back the same way,
and generator states are lists of integers.
"""

from __future__ import annotations

import io as _bytes_io
import random
from typing import Any

import numpy as np

GROUPS = ("model", "optimizer", "metrics", "seed")


def variable_groups(model) -> dict[str, list]:
    """Every variable that defines where training is, by group.

    - model: weights, BatchNormalization statistics, and the states of the layers'
      SeedGenerators (Dropout), which Keras keeps among the model's variables;
    - optimizer: iteration count, learning-rate variable, slots (momenta);
    - metrics: running totals of the epoch's metrics, so that a mid-epoch resume reports
      the same epoch averages;
    - seed: Keras's global SeedGenerator, when one exists.
    """
    groups = {
        "model": list(model.variables),
        "optimizer": list(model.optimizer.variables) if model.optimizer is not None else [],
        "metrics": list(model.metrics_variables),
        "seed": [],
    }
    generator = _global_seed_generator()
    if generator is not None:
        groups["seed"] = [generator.state]
    return groups


def _global_seed_generator():
    from keras_accel.utils import keras_internals

    keras_internals.check()  # A Keras without it is an error that names the version.
    return keras_internals.global_seed_generator()


def to_numpy(variable) -> np.ndarray:
    """The value of a Keras variable on the host, whatever the backend and the layout."""
    value = variable.value
    # A JAX array spread over several processes: replicated values are read from a local
    # copy (data parallelism); truly sharded ones would need a gather of all processes.
    if getattr(value, "is_fully_addressable", True) is False:
        if getattr(value, "is_fully_replicated", False):
            return np.asarray(value.addressable_shards[0].data)
        raise NotImplementedError(
            f"Variable {variable.path!r} is sharded across processes; saving it needs a "
            "gather over processes, which keras_accel checkpoints do not do yet."
        )
    # Variable.numpy() reads a tf.distribute variable inside a strategy scope too, where
    # converting its `.value` fails; a sync-on-read metric total comes back summed.
    return np.asarray(variable.numpy())


def _storable(array: np.ndarray) -> tuple[np.ndarray, str]:
    """An array numpy can save without pickle, and the dtype name to restore it."""
    dtype = array.dtype
    if dtype.kind in "biufc":
        return array, dtype.name
    # bfloat16, float8, ... (ml_dtypes) have no .npy type: store the bits.
    return array.view(f"uint{dtype.itemsize * 8}"), dtype.name


def _restored(array: np.ndarray, dtype_name: str) -> np.ndarray:
    if array.dtype.name == dtype_name:
        return array
    import ml_dtypes  # noqa: F401 - registers bfloat16 and friends with numpy.

    return array.view(np.dtype(dtype_name))


def save_variables(groups: dict[str, list]) -> tuple[bytes, list[dict]]:
    """`(npz bytes, manifest)`: the manifest lists group, path, shape and dtype of each."""
    arrays: dict[str, np.ndarray] = {}
    manifest = []
    for group in GROUPS:
        for index, variable in enumerate(groups.get(group, [])):
            array = to_numpy(variable)
            key = f"{group}/{index:05d}"
            arrays[key], dtype_name = _storable(array)
            manifest.append(
                {
                    "key": key,
                    "group": group,
                    "path": variable.path,
                    "shape": list(array.shape),
                    "dtype": dtype_name,
                }
            )
    buffer = _bytes_io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue(), manifest


def load_variables(data: bytes, manifest: list[dict]) -> dict[str, np.ndarray]:
    """Arrays by manifest key; raises ValueError if the archive lacks one or holds junk."""
    with np.load(_bytes_io.BytesIO(data), allow_pickle=False) as archive:
        names = set(archive.files)
        missing = [entry["key"] for entry in manifest if entry["key"] not in names]
        if missing:
            raise ValueError(f"the variables archive lacks {missing[:5]}")
        return {
            entry["key"]: _restored(archive[entry["key"]], entry["dtype"]) for entry in manifest
        }


def check_compatible(groups: dict[str, list], manifest: list[dict], source: str) -> None:
    """Raise a ValueError naming the first variable whose count or shape differs."""
    for group in ("model", "optimizer"):
        live = groups.get(group, [])
        saved = [entry for entry in manifest if entry["group"] == group]
        if len(live) != len(saved):
            live_paths = [v.path for v in live]
            saved_paths = [entry["path"] for entry in saved]
            extra = [p for p in live_paths if p not in saved_paths][:5]
            lacking = [p for p in saved_paths if p not in live_paths][:5]
            raise ValueError(
                f"The checkpoint {source} is from a different model: it holds "
                f"{len(saved)} {group} variables, this {group} has {len(live)}. Only in this "
                f"{group}: {extra}; only in the checkpoint: {lacking}. Restore it into the "
                "model (and optimizer) it was saved from, or use another backup_dir."
            )
        for variable, entry in zip(live, saved):
            shape = tuple(int(d) for d in variable.shape)
            if shape != tuple(entry["shape"]):
                raise ValueError(
                    f"The checkpoint {source} does not fit this model: variable "
                    f"{variable.path!r} has shape {shape} here but {tuple(entry['shape'])} in "
                    f"the checkpoint (saved as {entry['path']!r}). Restore it into the model "
                    "it was saved from, or use another backup_dir."
                )


def assign_variables(
    groups: dict[str, list],
    manifest: list[dict],
    arrays: dict[str, np.ndarray],
    which: tuple[str, ...] = GROUPS,
) -> None:
    """Assign saved arrays to live variables, group by group, in saved order."""
    for group in which:
        live = groups.get(group, [])
        saved = [entry for entry in manifest if entry["group"] == group]
        if group in ("metrics", "seed") and len(live) != len(saved):
            # Metrics are rebuilt by compile() and the global generator may not exist yet;
            # they only refine a resume, so a different set is skipped, not an error.
            continue
        for variable, entry in zip(live, saved):
            variable.assign(arrays[entry["key"]].astype(variable.dtype, copy=False))


def rng_state() -> dict[str, Any]:
    """Python's and NumPy's global generator states, as JSON-able data."""
    version, internal, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": [int(k) for k in numpy_state["state"]["key"]],
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state`."""
    python = state["python"]
    random.setstate((python["version"], tuple(python["state"]), python["gauss_next"]))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["bit_generator"],
            np.asarray(numpy_state["key"], dtype="uint32"),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["gauss"],
        )
    )
