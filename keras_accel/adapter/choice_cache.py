"""The compiled-or-plain decisions (`keras_accel.adapter.choice`), remembered in the process and
on disk, under a fingerprint of everything that decides them.

A decision holds for one model architecture, its compile arguments, its steps' input
signature, one machine and one set of library versions; the fingerprint is a hash of all of
them, so a changed model, batch shape, machine or version is measured again instead of
reusing a stale decision:

- the model: its class, and its config (`get_config()`) with the layers' generated names
  replaced by their order of appearance (a tuner's next trial builds "dense_7" where the
  first built "dense_1"); a model of the user's own class adds the hash of its class's
  source (and of its own layer classes'), since its `call` may compute anything; a model
  whose config or source cannot be read has no fingerprint, and its decision is kept for
  that model object only;
- the compile arguments (`get_compile_config()`): the loss, metrics, optimizer,
  `steps_per_execution`;
- the step kind, the input signature (shapes, dtypes) and steps per host call;
- the machine (processor model, cores, operating system), the device, and the versions of
  Python, Keras, keras_accel and the backend's library.

On disk: one small JSON file, `<Keras home>/keras_accel/compile_choices.json` (Keras's home is
`KERAS_HOME` or `~/.keras`), written whole by atomic rename, newest `LIMIT` entries kept.
A file that cannot be read or written costs only a measurement: the decision is then made
again. `KERAS_ACCEL_JIT_COMPILE_CACHE=0` neither reads nor writes it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import platform
import sys
import tempfile
import threading
import time
import warnings

from keras_accel.utils import keras_internals

FILE = "compile_choices.json"
LIMIT = 512
SWITCH = "KERAS_ACCEL_JIT_COMPILE_CACHE"

_DECISIONS: dict[str, dict] = {}  # This process's, by fingerprint.
_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get(SWITCH, "1") != "0"


def forget() -> None:
    """Forget this process's decisions (the file stays)."""
    with _LOCK:
        _DECISIONS.clear()


def path() -> str:
    from keras_accel.utils import keras_internals

    return os.path.join(keras_internals.keras_home(), "keras_accel", FILE)


def lookup(fingerprint: str | None) -> dict | None:
    """The decision (its fields, as `remember` took them) remembered under `fingerprint`,
    in this process or on disk."""
    if fingerprint is None:
        return None
    with _LOCK:
        found = _DECISIONS.get(fingerprint)
    if found is not None or not enabled():
        return found
    entry = _read().get(fingerprint)
    if not isinstance(entry, dict):
        return None
    with _LOCK:
        _DECISIONS[fingerprint] = entry
    return entry


def remember(fingerprint: str | None, decision: dict) -> None:
    """Keep `decision` (a dict of JSON values) under `fingerprint`, in this process and on
    disk."""
    if fingerprint is None:
        return
    with _LOCK:
        _DECISIONS[fingerprint] = decision
    if not enabled():
        return
    entries = _read()
    entries[fingerprint] = {**decision, "saved": time.time()}
    if len(entries) > LIMIT:
        newest = sorted(entries.items(), key=lambda kv: kv[1].get("saved", 0), reverse=True)
        entries = dict(newest[:LIMIT])
    _write(entries)


def _read() -> dict:
    try:
        with open(path(), encoding="utf-8") as f:
            content = json.load(f)
    except (OSError, ValueError):  # None yet, unreadable or damaged: as if empty.
        return {}
    entries = content.get("entries") if isinstance(content, dict) else None
    return dict(entries) if isinstance(entries, dict) else {}


def _write(entries: dict) -> None:
    target = path()
    try:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=".compile_choices.", dir=os.path.dirname(target))
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "entries": entries}, f)
            os.replace(scratch, target)  # Whole or not at all, for every reader.
        finally:
            if os.path.exists(scratch):
                os.unlink(scratch)
    except OSError:  # A read-only home: the decision holds for this process only.
        pass


# ---------------------------------------------------------------------------- fingerprint


def fingerprint(model, kind: str, signature, details: dict | None = None) -> str | None:
    """The key of `model`'s `kind` steps on inputs of `signature` (a JSON-able description
    of shapes and dtypes) on this machine, or None where the model cannot be described."""
    with warnings.catch_warnings(), keras_internals.tensorflow_left_unimported():
        # Keras's serialization warns about its own objects (a variable's `__array__`):
        # nothing the user asked for, and not theirs to act on. Nor does it import
        # TensorFlow into a torch or JAX process for it (150 MB, 3 s).
        warnings.simplefilter("ignore")
        described = _model(model)
        compiled = _compile_config(model)
    if described is None:
        return None
    parts = {
        "model": described,
        "compile": _canonical(compiled),
        "kind": kind,
        "signature": signature,
        "machine": _machine(),
        "versions": _versions(),
        "details": details or {},
    }
    text = json.dumps(parts, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _model(model):
    try:
        config = model.get_config()
        json.dumps(config, default=repr)
    except Exception:  # No config to read: this model object only.
        return None
    description = {"class": _qualified(type(model)), "config": _canonical(config)}
    own = {
        type(obj)
        for obj in [model, *_layers(model)]
        if not type(obj).__module__.startswith(("keras.", "keras_hub."))
    }
    if own:
        try:
            description["source"] = sorted(
                hashlib.sha256(inspect.getsource(cls).encode()).hexdigest() for cls in own
            )
        except (OSError, TypeError):  # A class defined where its source is not kept.
            return None
    return description


def _layers(model) -> list:
    from keras_accel.utils import keras_internals

    try:
        return keras_internals.flatten_layers(model, include_self=False)
    except Exception:
        return []


def _compile_config(model):
    try:
        return model.get_compile_config() or {}
    except Exception:
        return {"unserializable": True}


def _canonical(config):
    """`config` with every generated layer or object name replaced by its order of first
    appearance (names only link the parts of a config; what they are called changes
    nothing that runs)."""
    names: dict[str, str] = {}

    def collect(node):
        if isinstance(node, dict):
            name = node.get("name")
            if isinstance(name, str) and name not in names:
                names[name] = f"<name {len(names)}>"
            for value in node.values():
                collect(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                collect(value)

    def replace(node):
        if isinstance(node, dict):
            return {k: replace(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [replace(v) for v in node]
        if isinstance(node, str):
            return names.get(node, node)
        return node

    collect(config)
    return replace(json.loads(json.dumps(config, default=repr)))


def _qualified(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _machine() -> dict:
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "processor": _processor(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }


def _processor() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _versions() -> dict:
    from importlib import metadata

    import keras

    from keras_accel.utils.version import __version__

    versions = {
        "python": ".".join(map(str, sys.version_info[:2])),
        "keras": keras.__version__,
        "keras_accel": __version__,
    }
    backend = keras.backend.backend()
    library = {"tensorflow": "tensorflow", "torch": "torch", "jax": "jaxlib"}.get(backend)
    if library is not None:
        try:
            versions[library] = metadata.version(library)
        except metadata.PackageNotFoundError:
            versions[library] = sys.modules[library].__version__ if library in sys.modules else "?"
    return versions
