"""Orbax on JAX: sharded, asynchronous, atomic checkpoints of `jax.Array`s, where they live."""

from __future__ import annotations

import contextlib
import json
import os
import re

import jax

try:
    import orbax.checkpoint as ocp
except ImportError as error:  # pragma: no cover - exercised on installs without orbax
    raise ImportError(
        "BackupAndRestore on KERAS_BACKEND=jax stores training state through Orbax, which is "
        "not installed. Install it with `pip install orbax-checkpoint` (part of "
        '`pip install "keras-accel[jax]"`).'
    ) from error

from keras_accel.state import checksums, files, staged
from keras_accel.utils import process

NAME = "orbax"
STAGED_TAG = "orbax"  # Checkpoint N at a URL Orbax cannot write: `<backup_dir>/orbax-N/`.
# Staged over several processes, each process stages its own shards (`per_process`).
STAGED_PER_PROCESS = True
RECORDS = True  # `Engine(record=...)`: it writes checksum records (the staged path: off).
WRITES = "local paths and gs:// itself, and through a local staging directory any URL fsspec has"
STATE, META = "state", "meta"
# Orbax writes step N into `N.orbax-checkpoint-tmp...` and renames it when committed.
_TMP = re.compile(r"^(\d+)\.orbax-checkpoint-tmp[^/]*")
_COMMITTED = "commit_success.txt"  # Orbax's commit marker on object stores.
# Orbax's bookkeeping, which it rewrites at the commit, after the checksum record: the step's
# metadata (its commit time) and its commit markers. Not training state.
_UNRECORDED = ("_CHECKPOINT_METADATA", _COMMITTED)
# The step's files Orbax reads as JSON (its metadata; the arrays are tensorstore's). Checked
# to parse before Orbax reads them: `_CHECKPOINT_METADATA` has no checksum, and a record can
# be re-sealed by anyone who can write the folder; either way such a file is damage.
_JSON = ("_CHECKPOINT_METADATA", "_METADATA", "_sharding", "metadata")


def native(path: str) -> bool:
    # Orbax writes through etils.epath and tensorstore: local paths and gs://.
    return files.scheme(path) in ("", "file", "gs")


def supports(path: str) -> bool:
    # Other schemes (s3://) are staged locally and uploaded (keras_accel.state.staged).
    return native(path) or staged.supports(path)


def _check_json(path: str, name: str) -> None:
    """The metadata file `path` (`name` in messages) parses as JSON, as Orbax reads it: a
    text parser, which runs nothing whatever the bytes."""
    try:
        json.loads(files.read_bytes(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise checksums.Damaged(
            name, f"not the JSON Orbax writes there ({type(error).__name__}: {str(error)[:120]})"
        ) from error


def _key(key: str) -> str:
    # One flat tree: Orbax names each array by its key; "/" would be read as nesting.
    return key.replace("/", "|")


def _interrupted(directory: str) -> dict[int, str]:
    """{step: the leftover's name} for the saves a kill interrupted in `directory`.

    Locally Orbax writes step N into `N.orbax-checkpoint-tmp...` and renames it when
    committed. On an object store (gs://), where there is no rename, it writes `N/` in place
    and commits it with `N/commit_success.txt`, written last: a numbered prefix without it
    was never committed."""
    try:
        names = files.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    found = {int(m.group(1)): m.group(0) for m in map(_TMP.match, names) if m}
    if files.is_remote(directory):
        for name in names:
            if name.isdigit() and not files.exists(files.join(directory, name, _COMMITTED)):
                found[int(name)] = name
    return dict(sorted(found.items()))


class Engine:
    name = NAME

    def __init__(
        self,
        directory: str,
        max_to_keep: int,
        asynchronous: bool,
        per_process: bool = False,
        record: bool = True,
        signing_key: bytes | None = None,
    ):
        """`per_process`: `directory` is this process's own (a staging directory, or a
        download of a staged step), not one that every process sees. Orbax's primary host
        creates the step's directories and metadata and the others wait to see them (they
        hung for ever in a directory of their own), so every process is its own primary
        here (Orbax's `primary_host=None`, made for process-local storage) and writes its
        arrays' shards and the metadata. Without OCDBT: each shard is a file of its own
        (`state/<key>/<chunk>`), written by the one process that holds it, so the files
        of all processes together are the whole checkpoint; with OCDBT each process's
        per-process database is merged by the one primary host, which there is none of.

        `record`: write each step's checksum record (`keras_accel.state.checksums`) into
        it before Orbax commits it. Orbax's post-finalization callback does it, in Orbax's
        writer thread, after its handlers finalized the step and before the rename (or
        the commit marker on gs://): a step is committed with its record or not at all.
        Only Orbax's asynchronous checkpointer runs that callback, so with `record` every
        save is asynchronous and `asynchronous=False` waits for it. The staged path records
        the files in its own marker instead (`record=False` there).

        `signing_key`: sign each record for its step, and refuse at `verify` a step whose
        record is missing, unsigned or does not verify (`checksums.verify`). The files
        Orbax rewrites at its commit, after the record (`_UNRECORDED`), stay outside it:
        see docs/callbacks.md, "Signed backups", for why they are safe."""
        self.directory = files.local_path(directory)
        self._key = signing_key
        self.asynchronous = asynchronous
        self.record = record
        self._writing: int | None = None  # The step of the save in flight.
        # Saves a kill interrupted, found before the manager removes their leftovers.
        leftovers = _interrupted(self.directory)
        self.interrupted = sorted(leftovers)
        self._primary = per_process or jax.process_index() == 0
        self._shared = not per_process  # One directory, Orbax's deletions collective.
        if leftovers and self._primary:
            # The leftovers are removed before the manager exists: Orbax's own cleanup runs
            # in a thread that may not have finished when a caller (or the user) looks, and
            # removing them beside it made that thread fail the next save (FileNotFoundError).
            # On gs:// nothing of Orbax's removes an uncommitted step at all.
            for name in leftovers.values():
                with contextlib.suppress(FileNotFoundError):
                    files.rmtree(files.join(self.directory, name))
        hosts = ocp.options.MultiprocessingOptions(primary_host=None if per_process else 0)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=asynchronous or record,
            async_options=ocp.options.AsyncOptions(post_finalization_callback=self._seal)
            if record
            else None,
            create=True,
            # Leftovers of a save that a kill interrupted are removed when a run starts.
            cleanup_tmp_directories=True,
            multiprocessing_options=hosts,
            enable_per_process_directory_creation=per_process,
        )
        handlers = {
            # Training state is floating point noise to a compressor: zstd cost the writer
            # thread 2.5x the time (measured, benchmarks/checkpoint_overhead.py) for next
            # to no space, and that thread shares the host's cores with the input pipeline.
            STATE: ocp.PyTreeCheckpointHandler(
                use_compression=False, use_ocdbt=not per_process, multiprocessing_options=hosts
            ),
            META: ocp.JsonCheckpointHandler(multiprocessing_options=hosts),
        }
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        )

    def _seal(self) -> None:
        """Orbax's post-finalization callback (its writer thread, on the primary host): the
        record of the step's files, written into the step before Orbax commits it."""
        step = self._writing
        checksums.seal(self._unfinished(step), skip=_UNRECORDED, key=self._key, step=step)

    def _unfinished(self, step: int) -> str:
        """Where Orbax writes step `step` before it commits it: locally the temporary
        directory it then renames, on an object store the step itself."""
        if files.is_remote(self.directory):
            return self.path(step)
        names = [m.group(0) for m in map(_TMP.match, files.listdir(self.directory)) if m]
        names = [name for name in names if int(name.split(".", 1)[0]) == step]
        if len(names) != 1:
            raise RuntimeError(
                f"Orbax's temporary directory of step {step} in {self.directory!r} is not "
                f"the one expected: found {names}."
            )
        return files.join(self.directory, names[0])

    def save(self, step: int, variables: dict, meta: dict) -> None:
        tree = {_key(key): variable.value for key, variable in variables.items()}
        args = ocp.args.Composite(
            **{STATE: ocp.args.PyTreeSave(tree), META: ocp.args.JsonSave(meta)}
        )
        self.wait()  # Orbax waits for the save before too; its failure is raised here.
        self._writing = step
        # force: our save policy is the callback's (save_freq), not Orbax's.
        self.manager.save(step, args=args, force=True)
        if not self.asynchronous:
            self.wait()

    def path(self, step: int) -> str:
        return files.join(self.directory, str(step))

    def step_entries(self, step: int) -> list[str]:
        """The names in the directory that checkpoint `step` wrote (for staged uploads)."""
        return [str(step)]

    def files(self, step: int) -> tuple[str, str]:
        """(the file holding the arrays, the record) of checkpoint `step`: Orbax writes the
        arrays of one process into one data file of its OCDBT store, the largest file of
        the state directory."""
        state = os.path.join(self.path(step), STATE)
        found = [os.path.join(root, name) for root, _, names in os.walk(state) for name in names]
        arrays = max(found, key=os.path.getsize) if found else state
        return arrays, os.path.join(self.path(step), META)

    def wait(self) -> None:
        """Until the save in flight is committed. A save that failed (a full disk) is
        raised here, once, and its files are removed: nothing of it is left to look like
        a step (locally Orbax never renamed it; on gs:// it never got its commit marker)."""
        step = self._writing
        try:
            self.manager.wait_until_finished()
        except BaseException:
            if step is not None:
                self._discard(step)
            raise
        finally:
            # Only now: Orbax's thread reads it to find the step it records.
            self._writing = None

    def _discard(self, step: int) -> None:
        """Remove what a failed save of `step` wrote (the primary host; every process's
        files are in the one directory)."""
        if self._primary:
            leftovers = _interrupted(self.directory)
            names = [leftovers[step]] if step in leftovers else []
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    files.rmtree(files.join(self.directory, name))
        with contextlib.suppress(Exception):
            self.manager.reload()

    def verify(self, step: int) -> bool:
        """Check step `step`'s files against its checksum record (`checksums.verify`), and
        that its metadata files are the JSON Orbax reads them as: False where it has no
        record (written before records).

        Raises:
            checksums.Damaged: a file differs from the record, or is gone, or a metadata
                file is not JSON (a disk's fault, or a file planted there);
                `checksums.Tampered` with a signing key, where the record is missing,
                unsigned or forged, or lists not every file.
        """
        path = self.path(step)
        present = checksums.names_under(path, skip=_UNRECORDED)
        recorded = checksums.verify(path, key=self._key, step=step, present=present)
        for name in checksums.names_under(path):
            if name.rsplit("/", 1)[-1] in _JSON:
                _check_json(files.join(path, *name.split("/")), name)
        return recorded

    def set_aside(self, step: int) -> str:
        """Move the damaged step `step` to `damaged/` (kept, never listed again); returns
        where it is now."""
        target = checksums.aside(self.directory, str(step))
        if self._primary and files.is_remote(self.directory):
            # Removed through etils, Orbax's own file layer, whose file system object keeps
            # its listings: one that still showed the step would make Orbax's next save of
            # that step number remove it again, and fail (FileNotFoundError).
            from etils import epath

            files.copy(self.path(step), target)
            epath.Path(self.path(step)).rmtree()
        elif self._primary:
            files.move(self.path(step), target)
        self.manager.reload()
        return target

    def steps(self) -> list[int]:
        # Listed from disk, once the saves in flight are done (reloading while one is in
        # flight would drop it from the manager's rotation).
        self.wait()
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def read_meta(self, step: int) -> dict:
        restored = self.manager.restore(
            step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()})
        )
        return dict(restored[META])

    def restore(self, step: int, variables: dict, manifest: dict) -> None:
        """Assign checkpoint `step`'s values to `variables`, each read in its own layout
        (a sharded array straight onto its shards). Orbax reads a whole tree: saved arrays
        not asked for (a partial restore) are read onto one device and dropped."""
        spare = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        abstract = {}
        for key, entry in manifest.items():
            variable = variables.get(key)
            if variable is None:
                abstract[_key(key)] = jax.ShapeDtypeStruct(
                    tuple(entry["shape"]), entry["dtype"], sharding=spare
                )
            else:
                abstract[_key(key)] = jax.ShapeDtypeStruct(
                    tuple(variable.shape),
                    variable.value.dtype,
                    sharding=getattr(variable.value, "sharding", spare),
                )
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                **{STATE: ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args)}
            ),
        )[STATE]
        for key, variable in variables.items():
            variable.assign(restored[_key(key)])

    def has(self, step: int) -> bool:
        return step in self.steps()  # From disk: a step the chief set aside is gone.

    def delete(self, step: int) -> None:
        if step in self.steps():
            self.manager.delete(step)

    def delete_all(self) -> None:
        """Every process calls this: Orbax's deletion meets the other processes (its
        primary host deletes), so a process that skipped it would leave the others waiting."""
        self.wait()
        self.manager.reload()  # A save that finished while waiting is listed only now.
        steps = list(self.manager.all_steps())
        self._listed()
        for step in steps:
            self.manager.delete(step)

    def _listed(self) -> None:
        """Every process has listed the backups on disk before any deletes one. Orbax's
        deletion meets the other processes, its primary host deleting: a process that
        listed after that deletion (late, on a loaded machine) skipped the step, and left
        the others waiting in the deletion for good (seen once: a 2-process run whose
        chief never ended). Each process's own directory (`per_process`): nothing shared."""
        if self._shared:
            process.barrier("keras_accel_backups_listed")

    def close(self) -> None:
        self.manager.close()
