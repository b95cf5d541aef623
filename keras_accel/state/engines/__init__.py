"""Checkpoint engines: one module per Keras backend behind one small contract, imported lazily.

- JAX: Orbax (`orbax.checkpoint.CheckpointManager`), what JAX and Keras use: every array is
  written where it lives (sharded arrays by the processes that hold them, never gathered to
  one host), asynchronously, committed atomically, old steps rotated out.
- TensorFlow: `tf.train.Checkpoint` with `tf.train.CheckpointManager`, what the first seed
  uses: it saves a `MirroredVariable` once and restores it into every replica, writes
  through `tf.io.gfile` (`gs://` from a TPU host, which cannot write local files), and saves
  asynchronously (`CheckpointOptions(experimental_enable_async_checkpoint=True)`). Orbax
  would first copy every TensorFlow variable into host numpy arrays, with no knowledge of
  the strategy; tf.train is TensorFlow's own engine.
- torch: `torch.distributed.checkpoint` (DCP), what the torch field uses (torchtitan,
  Lightning's `ModelParallelStrategy`): every process hands it the whole (replicated) state
  and DCP spreads the writes over the processes, one key per writer (under torch's `fsdp`
  each process writes its own shards of the split variables, `DTensor`s); `.metadata`, written
  last, commits; `dcp.async_save` writes in a thread with collectives on a gloo group that is
  not training's; each process restores by reading every value it needs itself, so a
  checkpoint restores onto any number of processes (torch_dcp.py says more).

An engine opened on a directory answers:

- `save(step, variables, meta)`: the variables (`{key: keras.Variable}`) and a JSON-able
  `meta` dict, as one checkpoint of number `step`, committed atomically (the engine's own
  commit: Orbax's rename or commit marker, TensorFlow's index file and state file). It may
  return before the data is on disk;
- `wait()`: until every save is on disk (raises what a failed background save raised);
- `steps()`: the numbers of the committed checkpoints, oldest first;
- `has(step)`, `read_meta(step)`, `restore(step, variables, manifest)` (assigns the saved
  values into the given variables; `manifest` is what the checkpoint holds),
  `delete(step)`, `delete_all()`, `close()`;
- every process of a run calls `save`, `restore`, `delete`, `delete_all` and `close`, in
  the same order: an engine's own multi-process protocol may meet the other processes
  there (Orbax's does), and the engine decides which process writes or deletes what;
- `verify(step)`: check the step's files against the sizes and CRC32Cs its commit recorded
  (`keras_accel.state.checksums`; tf.train: every tensor through TensorFlow's own checks),
  raising `checksums.Damaged` naming the file and what differs; False where there is no
  record to check against (a step written before records). It also reads the metadata the
  engine's library would read, without running anything from it (DCP's `.metadata`
  through an allow-list unpickler, `dcp_metadata`; Orbax's JSON): a file that could run
  code or is not what the library writes there is damage too. An engine opened with a
  `signing_key` signs each record for its step and raises `checksums.Tampered` (a
  `Damaged`) where a step's record is missing, unsigned or does not verify.
  `set_aside(step)` moves a damaged step under `damaged/`, out of every listing, and
  returns where it is now;
- a failed save (a full disk) raises from `save` or `wait`, once, with its files removed;
- `path(step)` and `files(step)` (the arrays and the record, for Keras's `_weights_path`);
- `interrupted`: the numbers of saves found uncommitted when it opened (a process killed
  while writing them), whose leftovers it removes; never listed by `steps()`;
- `directory`, `name`, and `supports(path)` for the paths it can write.

Orbax and tf.train write some schemes themselves (`native(path)`: local paths, gs://); at
other URLs (s3://) `open_engine` wraps them in `keras_accel.state.staged`, which saves into
a local staging directory and uploads each step with a commit marker written last. For
that their engines also answer `step_entries(step)`, and their modules name `STAGED_TAG`.
"""

from __future__ import annotations

import importlib

ENGINES = {"jax": "orbax", "tensorflow": "tf_train", "torch": "torch_dcp"}


def engine_module(backend: str):
    """The engine module for a Keras backend; a clear error where there is none."""
    name = ENGINES.get(backend)
    if name is None:
        raise NotImplementedError(
            f"keras_accel stores training state through Orbax (KERAS_BACKEND=jax), "
            f"tf.train (KERAS_BACKEND=tensorflow) or torch.distributed.checkpoint "
            f"(KERAS_BACKEND=torch). Received: KERAS_BACKEND={backend!r}. Use one of those "
            "backends for BackupAndRestore."
        )
    return importlib.import_module(f"keras_accel.state.engines.{name}")


def open_engine(
    backend, directory: str, max_to_keep: int, asynchronous: bool, signing_key: bytes | None = None
):
    """An engine on `directory` for a backend (or an engine module): the module's own where
    it writes that scheme itself, else one staged through the local disk and uploaded with
    fsspec (`keras_accel.state.staged`: Orbax and tf.train on s3://). `signing_key`: every
    step's record signed, and a step without a record that verifies refused
    (`keras_accel.state.checksums`)."""
    module = engine_module(backend) if isinstance(backend, str) else backend
    native = getattr(module, "native", None)
    key = {} if signing_key is None else {"signing_key": signing_key}
    if native is not None and not native(directory):
        from keras_accel.state import staged

        return staged.Engine(module, directory, max_to_keep, asynchronous, **key)
    return module.Engine(directory, max_to_keep, asynchronous, **key)
