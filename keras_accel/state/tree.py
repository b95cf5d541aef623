"""The training state as variables keyed by path, and the checks a restore makes first.

Keras names every variable by its path (`sequential/dense/kernel`, `adam/iterations`), as
`model.get_state_tree()` does. State is saved and restored by those names, never by order:
two same-shaped variables that change places (a refactored model, a new Keras that orders
variables differently) can no longer load into each other, and a checkpoint that does not fit
the model says which variables are missing, extra or reshaped.
"""

from __future__ import annotations

import base64
import random
import re
import warnings
from typing import Any

import keras
import numpy as np

# Which variables define where training is, by group.
GROUPS = ("model", "optimizer", "metrics", "seed")
# A restore must match these exactly (unless the user asks for a partial one). Metric totals
# are rebuilt by compile() and the global seed generator may not exist yet: they only refine
# a resume, so entries that do not match are left as they are.
STRICT = ("model", "optimizer")


GLOBAL_SEED = "seed/global/seed_generator_state"


def variables(model, legacy: bool = False) -> dict[str, keras.Variable]:
    """`{"<group>/<path>": variable}` for every variable that defines where training is.

    - model: weights, BatchNormalization statistics, and the states of the layers'
      SeedGenerators (Dropout), which Keras keeps among the model's variables;
    - optimizer: iteration count, learning-rate variable, slots (momenta);
    - metrics: running totals of the epoch's metrics, so that a mid-epoch resume reports
      the same epoch averages;
    - seed: Keras's global SeedGenerator, when one exists.

    A SeedGenerator's variable path is `seed_generator_<n>/seed_generator_state`, numbered by
    Keras in the order generators are created in the session, and without its layer: two
    Dropout layers created in the other order would swap states. Here a layer's generator
    state is keyed by the layer instead (`model/<layer name>[/<sublayer>]/seed_generator_state`,
    `~2` for its second), the global one as `seed/global/seed_generator_state`; keys that
    never depend on creation order. `legacy=True` gives the keys backups written before
    (`model/seed_generator_1/seed_generator_state`), which `readable` falls back to.
    """
    from keras_accel.utils import keras_internals

    optimizer = getattr(model, "optimizer", None)  # An uncompiled model has no attribute.
    groups = {
        "model": list(model.variables),
        "optimizer": list(optimizer.variables) if optimizer is not None else [],
        "metrics": list(model.metrics_variables),
        "seed": [],
    }
    generator = keras_internals.global_seed_generator()
    if generator is not None:
        groups["seed"] = [generator.state]
    owners = {} if legacy else _seed_owners(model)
    keyed: dict[str, keras.Variable] = {}
    for group in GROUPS:
        seen: dict[str, int] = {}
        for variable in groups[group]:
            key = f"{group}/{variable.path}"
            if group == "model" and id(variable) in owners:
                key = f"{group}/{owners[id(variable)]}"
            elif group == "seed" and not legacy:
                key = GLOBAL_SEED
            # Keras paths are unique in practice; two variables sharing one keep their order.
            seen[key] = seen.get(key, 0) + 1
            keyed[key if seen[key] == 1 else f"{key}~{seen[key]}"] = variable
    return keyed


def _seed_owners(model) -> dict[int, str]:
    """`{id(state variable): "<layer names>/seed_generator_state[~n]"}` for every seed
    state a layer holds beside its weights (`layer.variables` minus `layer.weights`),
    attributed to the innermost model layer that holds it, walking `layers` of nested
    models (a custom layer's sublayers count as its own, in its own order)."""
    owners: dict[int, tuple[str, int]] = {}

    def walk(layer, prefix: str, depth: int) -> None:
        weights = {id(w) for w in layer.weights}
        count = 0
        for variable in layer.variables:
            if id(variable) in weights:
                continue
            count += 1
            if depth > 0 and owners.get(id(variable), ("", -1))[1] < depth:
                name = prefix + variable.name + ("" if count == 1 else f"~{count}")
                owners[id(variable)] = (name, depth)
        for child in getattr(layer, "layers", None) or []:
            walk(child, f"{prefix}{child.name}/", depth + 1)

    walk(model, "", 0)
    return {key: name for key, (name, _) in owners.items()}


def built_variables(model) -> dict[str, keras.Variable]:
    """`variables(model)` once the optimizer is built: its variables are saved and restored
    too."""
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    return variables(model)


def keyed_as(model, state: dict[str, keras.Variable], saved: dict) -> dict[str, keras.Variable]:
    """`state` (the variables of `model`) under the keys of a backup's manifest `saved`:
    older backups keyed seed states by Keras's creation-ordered names (`readable`); a model
    built again in this Python session has Keras's next automatic names (`renumbered`)."""
    return renumbered(readable(state, variables(model, legacy=True), saved), saved)


def readable(
    state: dict[str, keras.Variable], legacy: dict[str, keras.Variable], saved: dict
) -> dict[str, keras.Variable]:
    """`state` keyed as the checkpoint `saved` names its variables: a seed state saved
    under its old, creation-ordered key (a backup written before the keys above) is read
    from there, when its key is not in the checkpoint and the old one is."""
    old = {id(variable): key for key, variable in legacy.items()}
    mapped = {}
    for key, variable in state.items():
        before = old.get(id(variable), key)
        if key not in saved and before in saved and before not in state:
            key = before
        mapped[key] = variable
    return mapped


def manifest(state: dict[str, keras.Variable]) -> dict[str, dict]:
    """`{key: {"shape": [...], "dtype": "float32"}}`: what a checkpoint holds."""
    return {
        key: {"shape": [int(d) for d in variable.shape], "dtype": str(variable.dtype)}
        for key, variable in state.items()
    }


class IncompatibleCheckpoint(ValueError):
    """The checkpoint does not fit the model: variables missing, extra or reshaped."""


def to_restore(
    state: dict[str, keras.Variable], saved: dict[str, dict], source: str, partial: bool = False
) -> dict[str, keras.Variable]:
    """The variables to restore from a checkpoint whose manifest is `saved`.

    Raises:
        IncompatibleCheckpoint: a model or optimizer variable is missing from the checkpoint,
            extra in it, or of another shape, naming them (unless `partial`: then those are
            left as they are, with a warning naming them).
    """
    missing, extra, reshaped = [], [], []
    chosen = {}
    for key, variable in state.items():
        group = key.split("/", 1)[0]
        entry = saved.get(key)
        shape = [int(d) for d in variable.shape]
        if entry is None:
            if group in STRICT:
                missing.append(key)
            continue
        if list(entry["shape"]) != shape:
            if group in STRICT:
                reshaped.append((key, f"{tuple(entry['shape'])} saved, {tuple(shape)} here"))
            continue
        chosen[key] = variable
    extra = [k for k in saved if k not in state and k.split("/", 1)[0] in STRICT]
    problems = []
    if missing:
        problems.append(f"not in the checkpoint: {_names(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in this model: {_names(extra)}")
    if reshaped:
        problems.append(f"of another shape: {_names(reshaped)}")
    if problems and not partial:
        raise IncompatibleCheckpoint(
            f"The checkpoint {source} does not fit this model; variables "
            + "; ".join(problems)
            + ". "
            + "Restore it into the model (and optimizer) it was saved from, pass "
            "BackupAndRestore(partial_restore=True) to restore only the variables that match, "
            "or use another backup_dir."
        )
    if problems:
        warnings.warn(
            f"BackupAndRestore: partial restore from {source}: "
            + "; ".join(problems)
            + ". Those keep their current values.",
            stacklevel=3,
        )
    return chosen


# Keras numbers the layers, models and optimizers it names itself per Python session
# (`dense`, `dense_1`, ...; `adam_1/sequential_1_dense_2_kernel_momentum`).
_COUNTER = re.compile(r"_\d+(?=/|_|$)")


def renumbered(state: dict[str, keras.Variable], saved: dict) -> dict[str, keras.Variable]:
    """`state` under the checkpoint's keys where they differ only in Keras's automatic
    numbering: the same architecture built again in one Python session (a notebook's next
    cell), whose layers Keras numbers on (`sequential_1/dense_2/kernel` where the backup
    has `sequential/dense/kernel`).

    Applied only when the model and optimizer keys do not all match as they are. Keys that
    are the same once their numbers are removed pair up in order (the order of the model's
    and optimizer's variables, which the checkpoint's manifest keeps), as Keras's own
    `load_weights` pairs a model's layers; each such group must have as many model and
    optimizer variables on both sides, else `state` comes back as it is and `to_restore`
    names the difference. Shapes are checked by `to_restore` afterwards: a model that does
    not fit is still refused.
    """

    def strict(key: str) -> bool:
        return key.split("/", 1)[0] in STRICT

    if {k for k in state if strict(k)} == {k for k in saved if strict(k)}:
        return state
    ours: dict[str, list[str]] = {}
    theirs: dict[str, list[str]] = {}
    for key in state:
        ours.setdefault(_COUNTER.sub("", key), []).append(key)
    for key in saved:
        theirs.setdefault(_COUNTER.sub("", key), []).append(key)
    for stripped in set(ours) | set(theirs):
        mine = [k for k in ours.get(stripped, []) if strict(k)]
        other = [k for k in theirs.get(stripped, []) if strict(k)]
        if len(mine) != len(other):
            return state
    mapped = {}
    for stripped, keys in ours.items():
        names = theirs.get(stripped, [])
        if len(names) != len(keys):
            names = keys  # Metric totals or seeds that differ in number: only refinements.
        for key, name in zip(keys, names, strict=True):
            mapped[name] = state[key]
    return mapped


def _names(items: list, limit: int = 10) -> str:
    shown = ", ".join(
        f"{item[0]!r} {item[1]}" if isinstance(item, tuple) else repr(item)
        for item in items[:limit]
    )
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def snapshot(state: dict[str, keras.Variable]) -> dict[str, Any]:
    """Copies of the current values, to assign again later (a mid-epoch resume's replay).

    JAX arrays are copied on their devices, in their layout (Keras's compiled train step
    donates the buffers it is given, so a reference would not survive the next step);
    TensorFlow variables to host memory (their read sums a sync-on-read metric across
    replicas, as the assignment expects).
    """
    values = {}
    for key, variable in state.items():
        value = variable.value
        if hasattr(value, "addressable_shards"):
            values[key] = keras.ops.copy(value)
        else:
            values[key] = np.array(variable.numpy())
    return values


def assign(state: dict[str, keras.Variable], values: dict[str, Any]) -> None:
    for key, value in values.items():
        state[key].assign(value)


def rng_state() -> dict[str, Any]:
    """Python's and NumPy's global generator states, as JSON-able data; on torch, torch's
    too (an unseeded Dropout draws its masks from torch's global generator there: Keras's
    fast path, `torch.nn.functional.dropout`)."""
    version, internal, gauss_next = random.getstate()
    numpy_state = np.random.get_state(legacy=False)
    extra = {"torch": _torch_rng_state()} if keras.backend.backend() == "torch" else {}
    return {
        **extra,
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": [int(k) for k in numpy_state["state"]["key"]],
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
    }


def _torch_rng_state() -> dict[str, Any]:
    """torch's CPU generator state (and each CUDA device's, once CUDA is in use), base64."""
    import torch

    def encode(tensor) -> str:
        return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")

    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
    return {"cpu": encode(torch.get_rng_state()), "cuda": [encode(t) for t in cuda]}


def _set_torch_rng_state(state: dict[str, Any]) -> None:
    import torch

    def decode(text: str):
        return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

    torch.set_rng_state(decode(state["cpu"]))
    cuda = state.get("cuda") or []
    # A resume onto another number of devices: those saved go to the first ones here.
    if cuda and torch.cuda.is_available():
        for device, text in enumerate(cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(decode(text), device)


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of `rng_state` (torch's state is set only on torch, where it was saved)."""
    if "torch" in state and keras.backend.backend() == "torch":
        _set_torch_rng_state(state["torch"])
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
