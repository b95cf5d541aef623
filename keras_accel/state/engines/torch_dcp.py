"""torch.distributed.checkpoint (DCP) on torch: what the torch field checkpoints with.

Layout: checkpoint `N` is the directory `<backup_dir>/dcp-N` holding DCP's files (one
`__<rank>_0.distcp` per process that wrote data, and `.metadata`) and the JSON record
`meta.json`.

- **Who writes what.** Every process hands DCP the whole state (data parallelism keeps every
  variable replicated). DCP's planner finds the same keys in every process's plan and keeps
  each key in one plan only, the one with the fewest bytes so far (`dedup_save_plans`): the
  writes are spread over the processes, each writing its `__<rank>_0.distcp`, not all done
  by one. Under `strategy="fsdp"` the split variables hold `DTensor`s, and each process
  writes its own shards (DCP's native format for them; nothing gathered). The chief (DCP's
  coordinator, rank 0) writes `meta.json` before the save and
  `.metadata`, DCP's index of where each key lies, after every process has written its
  share. The directory must therefore be one that every process sees (a shared file system
  or a bucket), as Orbax's must.
- **Atomic commit.** DCP writes `.metadata` last, to a temporary name that is fsynced and
  renamed: a checkpoint is committed when its `.metadata` exists, and only those are listed
  by `steps()`. Just before, in DCP's `finish` on the coordinator (the thread that writes,
  once every process wrote its share), the chief records every file's size and CRC32C in
  `keras_accel.checksums.json` (`keras_accel.state.checksums`), which a restore checks
  first: DCP itself reads a damaged byte back without a word. With a signing key the
  record is signed and covers `.metadata` too, so it is written just after DCP's commit
  instead (`_writer`). A process killed while
  writing leaves a `dcp-N` without `.metadata`: found when an engine opens the directory
  (`interrupted`) and removed by the chief. Deleting a
  checkpoint removes its `.metadata` first, so a deletion that a kill interrupts leaves no
  checkpoint that looks complete.
- **Asynchronous save** (`dcp.async_save` across processes; in one process, DCP's saver in
  a thread of the engine's): the state is copied into host memory first (every tensor, CPU
  ones too, so training may change the variables at once), and the files are written in
  the background. Its collectives (DCP
  agrees on the plan, then on the end of the writes) run on a gloo process group that the
  engines make for themselves (one per process group, shared by the engines of a process,
  which save one at a time), never on the one training uses: two threads' collectives on
  one group would pair up wrongly. That group also makes it work where training runs on
  NCCL.
- **A restore runs no code from the backup.** DCP reads `.metadata` with `pickle.load`;
  here it is read through an allow-list unpickler instead (`dcp_metadata`), in `verify`
  and for the restore: a step whose index names anything else is set aside as damaged.
- **Restore onto any process count.** Each process reads every value it restores itself
  (`dcp.load(..., no_dist=True)`): from the files of any number of writers, into any number
  of readers, with no collective that a process could miss.
- **Paths.** Local paths, and URLs of the file systems fsspec has (DCP's `FsspecWriter`):
  `gs://` with gcsfs, `s3://` with s3fs, `memory://`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import json
import os
import re
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from keras_accel.state import checksums, files
from keras_accel.state.engines import dcp_metadata
from keras_accel.utils import library_internals, process

NAME = "torch.distributed.checkpoint"
WRITES = "local paths and URLs of the file systems fsspec has (gs:// with gcsfs, s3:// with s3fs)"
PREFIX = "dcp-"
META = "meta.json"
COMMIT = dcp_metadata.COMMIT  # DCP's own index, written last by the coordinator.
_NUMBER = re.compile(rf"^{PREFIX}(\d+)$")
# A process that never reaches a save's collectives (killed, hung) fails the others after
# this long instead of holding them for ever; longer than writing any state a host holds.
TIMEOUT_S = 1800.0


# DCP warns at every save and load without a process group that it assumes one process;
# here that is the intent (one process, or each process reading for itself): that message
# is held back around our calls (`_unwrapped`, `_save_alone`), and the filters left alone.
_ALONE = "torch.distributed is disabled, unavailable or uninitialized"


def supports(path: str) -> bool:
    kind = files.scheme(path)
    if kind in ("", "file"):
        return True
    import fsspec

    return kind in fsspec.available_protocols()


class Engine:
    name = NAME

    def __init__(
        self,
        directory: str,
        max_to_keep: int,
        asynchronous: bool,
        signing_key: bytes | None = None,
    ):
        """`signing_key`: sign each step's record for its step, over every file of the step
        `.metadata` included (the record is then written just after DCP's commit, see
        `_writer`), and refuse at `verify` a step whose record is missing, unsigned or
        does not verify."""
        self.directory = files.local_path(directory)
        self._key = signing_key
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self._pending = None  # (step, future) of the save in flight.
        # Saves a kill interrupted: a `dcp-N` without its `.metadata`. The chief removes them.
        self.interrupted = sorted(step for step, done in self._listed().items() if not done)
        if self.interrupted and process.is_chief():
            for step in self.interrupted:
                _remove_tree(self.path(step))

    # ------------------------------------------------------------------ the process group
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def _dist(self) -> dict:
        """DCP's process arguments: one process saves alone (no collectives); several agree
        on their plans over the engines' own group."""
        if not self._distributed():
            return {"no_dist": True}
        return {"process_group": _group()}

    # ------------------------------------------------------------------ saving
    def finish_writing(self) -> None:
        """Block until the save in flight, if any, has finished, leaving its outcome (an
        error) for this engine's own `wait` to raise."""
        pending = self._pending
        if pending is not None:
            concurrent.futures.wait([pending[1]])

    def save(self, step: int, variables: dict, meta: dict) -> None:
        """`variables`: `{key: keras.Variable, or a tensor made for the backup}` (the
        metrics' state over the processes, `RunContext.metric_state`). A variable split
        over the processes (`strategy="fsdp"`) holds a DTensor: DCP writes each process's
        shard into its own file, nothing gathered."""
        self.wait()  # One save in flight at a time; the previous one is committed first.
        # And one in the process: the engines of one process share their group, whose
        # collectives must come in the same order everywhere (another engine's error stays
        # for its own wait to raise).
        for other in list(_SAVING):
            if other is not self:
                other.finish_writing()
        path = self.path(step)
        if process.is_chief():
            try:
                files.makedirs(path)
                # Before DCP's commit, which the chief writes after every process's share.
                files.write_atomic(files.join(path, META), json.dumps(meta))
            except BaseException:
                self._failed(step)  # An empty `dcp-N` would read as a killed save.
                raise
        state = {key: _tensor(variable) for key, variable in variables.items()}
        writer = _writer(path, step, self._key)
        alone = not self._distributed()
        if self.asynchronous:
            if alone:
                # DCP's copy into host memory (a copy of CPU tensors too: training changes
                # the variables in place), then DCP's save in a thread of ours.
                staged = {key: value.to("cpu", copy=True) for key, value in state.items()}
                future = _executor().submit(_save_alone, staged, writer)
            else:
                future = dcp.async_save(state, storage_writer=writer, **self._dist())
            self._pending = (step, future)
            _SAVING.add(self)
            return
        try:
            with _unwrapped():
                if alone:
                    _save_alone(state, writer)
                else:
                    dcp.save(state, storage_writer=writer, **self._dist())
        except BaseException:
            self._failed(step)
            raise
        self._committed()

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        _SAVING.discard(self)
        if pending is None:
            return
        step, future = pending
        try:
            with _unwrapped():
                future.result()
        except BaseException:
            self._failed(step)
            raise
        self._committed()

    def _failed(self, step: int) -> None:
        # A save that raised never committed: its files are no checkpoint.
        if process.is_chief():
            _remove_tree(self.path(step))

    def verify(self, step: int) -> bool:
        """Check step `step`'s files against its checksum record, and read its `.metadata`
        (which the record cannot cover: DCP writes it last, as its commit) through the
        allow-list unpickler of `dcp_metadata`: False where it has no record (written
        before records).

        Raises:
            checksums.Damaged: a file differs from the record, or is gone;
                `dcp_metadata.Refused` where `.metadata` names anything no DCP index is
                made of (nothing of it run); `checksums.Tampered` with a signing key,
                where the record is missing, unsigned or forged, or lists not every file.
        """
        recorded = checksums.verify(self.path(step), key=self._key, step=step)
        dcp_metadata.read(self.path(step))
        return recorded

    def set_aside(self, step: int) -> str:
        """Move the damaged step `step` to `damaged/` (the chief; kept, never listed again);
        returns where it is now."""
        target = checksums.aside(self.directory, f"{PREFIX}{int(step)}")
        if process.is_chief():
            files.move(self.path(step), target)
        return target

    def _committed(self) -> None:
        """Rotation, once the newest save is committed: the chief removes the oldest
        checkpoints beyond `max_to_keep`."""
        if not process.is_chief():
            return
        steps = self._steps()
        for step in steps[: max(0, len(steps) - self.max_to_keep)]:
            self._delete(step)

    # ------------------------------------------------------------------ reading
    def path(self, step: int) -> str:
        return files.join(self.directory, f"{PREFIX}{int(step)}")

    def files(self, step: int) -> tuple[str, str]:
        """(the largest data file, the JSON record) of checkpoint `step`, for Keras's
        `_weights_path` and `_training_metadata_path`."""
        path = self.path(step)
        try:
            data = sorted(name for name in files.listdir(path) if name.endswith(".distcp"))
        except (FileNotFoundError, NotADirectoryError):
            data = []
        if data and not files.is_remote(path):
            data.sort(key=lambda name: os.path.getsize(os.path.join(path, name)), reverse=True)
        return (files.join(path, data[0]) if data else path), files.join(path, META)

    def _listed(self) -> dict[int, bool]:
        """{step: committed} for every `dcp-N` in the directory."""
        return files.numbered(
            self.directory, _NUMBER, lambda step: files.join(self.path(step), COMMIT)
        )

    def _steps(self) -> list[int]:
        return sorted(step for step, done in self._listed().items() if done)

    def steps(self) -> list[int]:
        """The committed checkpoints that rotation keeps, the newest `max_to_keep`: the same
        list on every process, whether or not the chief has deleted the older ones yet."""
        self.wait()  # A save in flight is listed once committed.
        return self._steps()[-self.max_to_keep :]

    def has(self, step: int) -> bool:
        return step in self.steps()

    def read_meta(self, step: int) -> dict:
        return json.loads(files.read_text(files.join(self.path(step), META)))

    def restore(self, step: int, variables: dict, manifest: dict) -> None:
        """Assign checkpoint `step`'s values to `variables`. Each process reads what it
        restores itself (no collective): any number of writers, any number of readers.
        Saved values not asked for (a partial restore) are not read."""
        targets = {
            key: torch.empty(tuple(variable.shape), dtype=_tensor(variable).dtype)
            for key, variable in variables.items()
        }
        with _unwrapped():
            dcp.load(targets, storage_reader=_reader(self.path(step)), no_dist=True)
        for key, variable in variables.items():
            variable.assign(targets[key])

    # ------------------------------------------------------------------ deleting
    def _delete(self, step: int) -> None:
        path = self.path(step)
        commit = files.join(path, COMMIT)
        if files.exists(commit):
            files.remove(commit)  # No longer listed, whatever happens next.
        _remove_tree(path)

    def delete(self, step: int) -> None:
        """Every process calls this; the chief deletes."""
        if process.is_chief():
            self._delete(step)

    def delete_all(self) -> None:
        """Every process calls this; the chief deletes, and every process returns once it
        has (a barrier of the engine's group, which fails after TIMEOUT_S naming the
        processes that never came)."""
        self.wait()
        if process.is_chief():
            for step in sorted(self._listed()):
                self._delete(step)
        if self._distributed():
            self._dist()
            dist.monitored_barrier(
                group=_group(),
                timeout=datetime.timedelta(seconds=TIMEOUT_S),
                wait_all_ranks=True,
            )

    def close(self) -> None:
        # The group stays, for the next engine (one group per process group, not one more
        # per fit); it ends with the process group.
        self.wait()


def _save_alone(state: dict, writer) -> None:
    """One process's DCP save, without the UserWarning with which `dcp.save` says that it
    saves in one process: in the background thread no filter of ours can hold it back where
    the caller turned warnings into errors (`-W error`), and the save would fail on it."""
    library_internals.dcp_save_in_one_process(state, writer)


_EXECUTOR: list = []


def _executor():
    """One writer thread for the single-process background saves (one at a time)."""
    if not _EXECUTOR:
        _EXECUTOR.append(
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="keras_accel-dcp")
        )
    return _EXECUTOR[0]


_SAVING: weakref.WeakSet = weakref.WeakSet()  # Engines of this process with a save in flight.
_GROUPS: dict = {}  # {id of the default group: the engines' gloo group}


def _group():
    """The engines' gloo group of this process group, made at the first collective call of
    any engine (every process calls save, delete_all and close in the same order, and
    `new_group` is collective over the default group). Not training's group: the
    background save's collectives would pair up wrongly with training's."""
    default = dist.group.WORLD
    key = id(default)
    entry = _GROUPS.get(key)
    if entry is None or entry[0] is not default:  # A new default group (init after destroy).
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
        _GROUPS.clear()
        _GROUPS[key] = entry = (default, group)
    return entry[1]


@contextlib.contextmanager
def _unwrapped():
    """DCP reports what failed on any process as a `CheckpointException`, a BaseException
    (past `except Exception`, where a damaged backup is skipped and a full disk named): the
    first process's own error is raised instead, DCP's report chained to it."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            # Also where the caller turned warnings into errors (`-W error`): DCP's note
            # that one process saves or loads alone is no fault here.
            warnings.filterwarnings("ignore", message=_ALONE)
            yield
    except CheckpointException as error:
        failures = sorted(error.failures.items())
        first = failures[0][1][0] if failures else None
        if not isinstance(first, Exception):
            raise
        raise first from error


def _tensor(variable) -> torch.Tensor:
    if isinstance(variable, torch.Tensor):  # A value made for the backup (`save`).
        return variable.detach()
    value = variable.value
    if not isinstance(value, torch.Tensor):  # pragma: no cover - a Keras change
        value = torch.as_tensor(variable.numpy())
    return value.detach()


def _writer(path: str, step: int, key: bytes | None):
    if files.is_remote(path):
        writer = library_internals.dcp_fsspec_writer(path)
    else:
        writer = dcp.FileSystemWriter(path)
    finish = writer.finish

    def recorded_finish(*args, **kwargs):
        # DCP's coordinator, once every process has written its share and before DCP's
        # commit (`.metadata`): a committed step always has its checksum record.
        if key is None:
            checksums.seal(path, skip=(COMMIT,))
            return finish(*args, **kwargs)
        # Signed: `.metadata` too, whose index says which bytes are which tensor (swapping
        # two same-shaped tensors' offsets changes no data file). So the record follows
        # DCP's commit; a step killed between the two has none, and is refused with the
        # key (the step before it restores).
        done = finish(*args, **kwargs)
        checksums.seal(path, key=key, step=step)
        return done

    # On the object, not a subclass: the writer class is DCP's (or fsspec's, reached
    # through library_internals), and `finish` is the public StorageWriter hook.
    writer.finish = recorded_finish
    return writer


def _reader(path: str):
    """DCP's reader for the step at `path`, handed the index that `dcp_metadata` read
    without running code (DCP's own `read_metadata` is a plain `pickle.load`)."""
    if files.is_remote(path):
        reader = library_internals.dcp_fsspec_reader(path)
    else:
        reader = dcp.FileSystemReader(path)
    return dcp_metadata.reader(path, reader)


def _remove_tree(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # Gone already (another cleanup, a rename).
        files.rmtree(path)
