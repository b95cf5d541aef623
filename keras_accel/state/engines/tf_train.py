"""tf.train on TensorFlow: `tf.train.Checkpoint` with `CheckpointManager`, asynchronous.

A damaged checkpoint is caught by TensorFlow's own checksums (each tensor's CRC32C in the
index, each index block's), so no record of ours is written: `verify` reads the step
through TensorFlow's reader before a restore, and raises `checksums.Damaged` naming the
file and TensorFlow's words for what differs.

With a signing key, TensorFlow's checksums are not enough (anyone can rewrite a tensor and
its CRC32C in the index): each step gets a signed record of ours,
`ckpt-N.keras_accel.checksums.json` beside its files (`keras_accel.state.checksums`),
written by TensorFlow's write callback (its writer thread, once the index is written, before
the manager lists the step in its state file), and checked before TensorFlow's own checks.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile

import tensorflow as tf

from keras_accel.state import checksums, files, staged
from keras_accel.utils import process

NAME = "tf.train"
PREFIX = "ckpt"
STAGED_TAG = "tf"  # Checkpoint N at a URL tf.io.gfile cannot write: `<backup_dir>/tf-N/`.
WRITES = (
    "local paths, gs:// and the schemes tf.io.gfile has itself, and through a local staging "
    "directory any URL fsspec has"
)
_META_KEYS = ("meta/.ATTRIBUTES/py_state", "meta/.ATTRIBUTES/VARIABLE_VALUE")  # New, old.


class _Meta(tf.train.experimental.PythonState):
    """The JSON record, saved inside the checkpoint (so it commits with the arrays). Not a
    string variable: one made under a multi-worker strategy would be broadcast between the
    workers by a collective, which takes no strings."""

    def __init__(self):
        self.value = ""

    def serialize(self):
        return self.value

    def _copy_trackable_to_cpu(self, object_map):
        # TF's asynchronous save writes host copies of what it saves, made by a traced
        # function (Python runs once, at trace time): the record is its own copy instead,
        # which `Engine.save` sets only once the previous write has finished.
        object_map[self] = self

    def deserialize(self, string_value):
        value = string_value.numpy() if hasattr(string_value, "numpy") else string_value
        self.value = value.decode("utf-8") if isinstance(value, bytes) else value


# TensorFlow's words for a damaged checkpoint: a tensor whose CRC32C differs ("TensorBundle
# at <prefix> shard 0 (65536 bytes): Checksum does not match: ..."), a data file shorter than
# the index says, an index that cannot be read ("Unable to read file (<prefix>.index) ...
# block checksum mismatch").
_SHARD = re.compile(r"shard (\d+) \(\d+ bytes\): (.*?)(?: \[Op:\w+\])?$", re.S)
_INDEX = re.compile(r"Unable to read file \((.*?\.index)\)\.? ?(.*)", re.S)
_SHORT = ("Read less bytes than requested", "Read fewer bytes than requested")
# TensorFlow's table reader on an index that is no table at all (overwritten, or a file of
# another kind planted there): a plain OpError, not a DataLossError.
_NOT_A_TABLE = ("not an sstable", "too short to be an sstable")
_NUMBER = re.compile(rf"^{PREFIX}-(\d+)$")
_TEMP = re.compile(rf"^{PREFIX}-(\d+)_temp")
_DATA = re.compile(rf"^{PREFIX}-(\d+)\.data-")
RECORD = f".{checksums.RECORD}"  # `ckpt-N` + this: step N's signed record (with a key).


def native(path: str) -> bool:
    # tf.io.gfile: local paths, gs://, and whatever file systems TensorFlow has registered.
    kind = files.scheme(path)
    return kind in ("", "file") or kind in _gfile_schemes()


def supports(path: str) -> bool:
    # Other schemes (s3://) are staged locally and uploaded (keras_accel.state.staged).
    return native(path) or staged.supports(path)


def _gfile_schemes() -> set[str]:
    schemes = {"gs", "ram"}
    get_registered = getattr(tf.io.gfile, "get_registered_schemes", None)  # TF >= 2.13.
    if get_registered is not None:
        schemes |= set(get_registered())
    return schemes


class Engine:
    name = NAME

    def __init__(
        self,
        directory: str,
        max_to_keep: int,
        asynchronous: bool,
        signing_key: bytes | None = None,
    ):
        """`signing_key`: write each step's signed record, and refuse at `verify` a step
        whose record is missing, unsigned or does not verify."""
        self.directory = files.local_path(directory)
        self._key = signing_key
        # A save that a kill interrupted leaves `ckpt-N_temp` (the shards, before TensorFlow
        # merges them), or, killed while merging, `ckpt-N.data-*` without `ckpt-N.index`
        # (written last): never listed as a checkpoint (the state file names complete ones
        # only), removed when a run starts here; on object stores (gs://) alike.
        interrupted = set()
        for path in tf.io.gfile.glob(os.path.join(self.directory, f"{PREFIX}-*")):
            name = os.path.basename(path)
            temp, data = _TEMP.match(name), _DATA.match(name)
            if temp or (data and not tf.io.gfile.exists(self._path(int(data.group(1))) + ".index")):
                interrupted.add(int((temp or data).group(1)))
                _remove(path)
        self.interrupted = sorted(interrupted)  # Those saves' numbers, as Orbax's engine reports.
        self.max_to_keep = max_to_keep
        # Under a multi-worker strategy every worker saves (reading a variable that is synced
        # on read is a collective), but only the chief into `directory`: the others write a
        # scratch copy, dropped after each save (TensorFlow's multi-worker recipe).
        self._scratch = None if process.is_chief() else tempfile.mkdtemp(prefix="keras-accel-")
        self.options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=asynchronous)
        self._checkpoint = None
        self._manager = None
        self._meta = None
        self._keys: tuple | None = None
        self._writing: int | None = None  # The step of the save in flight.

    def _bind(self, variables: dict) -> None:
        keys = tuple(variables)
        if self._keys == keys:
            return
        self.wait()
        self._meta = _Meta()
        self._checkpoint = tf.train.Checkpoint(
            values={key: variable.value for key, variable in variables.items()}, meta=self._meta
        )
        self._manager = tf.train.CheckpointManager(
            self._checkpoint,
            self._scratch or self.directory,
            max_to_keep=1 if self._scratch else self.max_to_keep,
            checkpoint_name=PREFIX,
        )
        self._keys = keys

    def save(self, step: int, variables: dict, meta: dict) -> None:
        self._bind(variables)
        self.wait()  # TF's save waits for the previous write too; the record is shared.
        self._meta.value = json.dumps(meta)
        self._writing = step
        options = self.options
        if self._key is not None and self._scratch is None:
            # A fresh list each save: the manager appends its own callback to the list of
            # a shallow copy of the options, which would keep every earlier save's.
            options = tf.train.CheckpointOptions(
                experimental_enable_async_checkpoint=self.options.experimental_enable_async_checkpoint,
                experimental_write_callbacks=[self._sealer(step)],
            )
        try:
            self._manager.save(checkpoint_number=step, options=options)
        except BaseException:
            self._writing = None
            self._discard(step)
            raise

    def _sealer(self, step: int):
        """TensorFlow's write callback for step `step` (one argument, the path, as TF
        requires), run in its writer thread once the files are written and before the
        manager lists the step: the step's signed record."""

        def seal(_path):
            checksums.seal(
                self.directory,
                key=self._key,
                step=step,
                names=self._names(step),
                into=self._record(step),
            )

        return seal

    def _record(self, step: int) -> str:
        return f"{PREFIX}-{int(step)}{RECORD}"

    def _names(self, step: int) -> list[str]:
        """The names of step `step`'s files in the directory, its record left out."""
        found = (os.path.basename(p) for p in tf.io.gfile.glob(f"{self._path(step)}.*"))
        return sorted(name for name in found if name != self._record(step))

    def path(self, step: int) -> str:
        return self._path(step)

    def step_entries(self, step: int) -> list[str]:
        """The names in the directory that checkpoint `step` wrote (for staged uploads)."""
        return sorted(os.path.basename(p) for p in tf.io.gfile.glob(f"{self._path(step)}.*"))

    def files(self, step: int) -> tuple[str, str]:
        """(the arrays, the index that holds the record) of checkpoint `step`."""
        data = sorted(tf.io.gfile.glob(f"{self._path(step)}.data-*"))
        return (data[0] if data else f"{self._path(step)}.data"), f"{self._path(step)}.index"

    def wait(self) -> None:
        """Until the save in flight is on disk. A save that failed in the background (a
        full disk) is raised here, once, and its files are removed (a `ckpt-N_temp`, or
        data without its index, would read as a killed save)."""
        step, self._writing = self._writing, None
        if self._checkpoint is None:
            return
        try:
            self._checkpoint.sync()
            index = os.path.join(self._scratch or self.directory, f"{PREFIX}-{step}.index")
            if step is not None and not tf.io.gfile.exists(index):
                self._raise_background_error(step)
        except BaseException:
            if step is not None:
                self._discard(step)
            raise

    def _raise_background_error(self, step: int) -> None:
        """Raise the error of step `step`'s background write, which ended without its index.

        `sync()` returns without it: TensorFlow keeps it for the checkpoint's next write,
        which raises it before it writes anything, and the next save would then report it
        as its own step's. A write is asked for at once, into a scratch prefix of a temporary
        directory (removed), to raise it here, at the step it belongs to."""
        scratch = tempfile.mkdtemp(prefix="keras_accel-tf-error-")
        try:
            self._checkpoint.write(os.path.join(scratch, "probe"), options=self.options)
            self._checkpoint.sync()
        finally:
            _remove(scratch)
        raise RuntimeError(
            f"TensorFlow's background write of step {step} to {self.directory!r} ended "
            "without its index, and TensorFlow kept no error for it."
        )

    def _discard(self, step: int) -> None:
        """Remove what a failed save of `step` wrote, none of which is listed: the state
        file names a step only once its index is written."""
        if self._scratch is not None:
            return
        for path in tf.io.gfile.glob(f"{self._path(step)}[._]*"):
            with contextlib.suppress(tf.errors.OpError):
                _remove(path)

    def verify(self, step: int) -> bool:
        """Read every tensor of step `step` through TensorFlow's checkpoint reader, which
        checks each against the CRC32C its index holds (True: checked). Checked before the
        restore, not by it: a restore that fails part-way leaves TensorFlow's objects
        waiting for the values it never assigned, which warn of them, a line each, when the
        process ends ("... is being deleted with unrestored values").

        With a signing key, the step's signed record is checked first.

        Raises:
            checksums.Damaged: a file is damaged (named, with TensorFlow's words);
                `checksums.Tampered` with a signing key, where the record is missing,
                unsigned or forged, or lists not every file of the step.
        """
        if self._key is not None:
            checksums.verify(
                self.directory,
                checksums.read(self.directory, self._record(step)),
                key=self._key,
                step=step,
                present=self._names(step),
                name=self._record(step),
            )
        with self._damaged_as(step):
            reader = tf.train.load_checkpoint(self._path(step))
            for name in reader.get_variable_to_dtype_map():
                reader.get_tensor(name)
        return True

    def set_aside(self, step: int) -> str:
        """Move the damaged step `step`'s files to `damaged/ckpt-N-<time>/` (the chief; kept,
        never listed again); returns where they are now."""
        target = checksums.aside(self.directory, f"{PREFIX}-{int(step)}")
        if process.is_chief():
            tf.io.gfile.makedirs(target)
            for path in tf.io.gfile.glob(f"{self._path(step)}.*"):
                tf.io.gfile.rename(path, os.path.join(target, os.path.basename(path)))
        return target

    def _damage(self, step: int, error: BaseException) -> checksums.Damaged | None:
        """`error` as `checksums.Damaged` where TensorFlow found step `step` damaged (its
        file and TensorFlow's words), else None (another failure: a store that did not
        answer, a missing permission)."""
        text = str(error)
        shard, index = _SHARD.search(text), _INDEX.search(text)
        data = sorted(tf.io.gfile.glob(f"{self._path(step)}.data-*"))
        checksum = isinstance(error, tf.errors.DataLossError) or "checksum" in text.lower()
        if shard and checksum and int(shard.group(1)) < len(data):
            return checksums.Damaged(os.path.basename(data[int(shard.group(1))]), shard.group(2))
        if index:
            return checksums.Damaged(os.path.basename(index.group(1)), index.group(2).strip())
        if any(words in text for words in _NOT_A_TABLE):
            return checksums.Damaged(f"{PREFIX}-{int(step)}.index", text.strip())
        if any(words in text for words in _SHORT):
            which = ", ".join(os.path.basename(path) for path in data) or "its data"
            return checksums.Damaged(which, f"shorter than its index says ({text.strip()})")
        if isinstance(error, tf.errors.DataLossError):
            return checksums.Damaged(f"{PREFIX}-{int(step)}", text.strip())
        return None

    @contextlib.contextmanager
    def _damaged_as(self, step: int):
        """Raise `checksums.Damaged` for TensorFlow's errors that mean a damaged file."""
        try:
            yield
        except Exception as error:  # TensorFlow's OpErrors, and its reader's own.
            damage = self._damage(step, error)
            if damage is None:
                raise
            raise damage from error

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{PREFIX}-{step}")

    def steps(self) -> list[int]:
        # What the state file lists (written after a save's files are complete), that also
        # has its index on disk.
        state = tf.train.get_checkpoint_state(self.directory)
        listed = list(state.all_model_checkpoint_paths) if state is not None else []
        numbers = []
        for path in listed:
            match = _NUMBER.match(os.path.basename(path))
            if match and tf.io.gfile.exists(f"{self._path(int(match.group(1)))}.index"):
                numbers.append(int(match.group(1)))
        return sorted(set(numbers))

    def read_meta(self, step: int) -> dict:
        with self._damaged_as(step):
            reader = tf.train.load_checkpoint(self._path(step))
            key = next((k for k in _META_KEYS if reader.has_tensor(k)), _META_KEYS[0])
            value = reader.get_tensor(key)
        return json.loads(value.decode("utf-8") if isinstance(value, bytes) else value)

    def has(self, step: int) -> bool:
        return step in self.steps()

    def restore(self, step: int, variables: dict, manifest: dict) -> None:
        checkpoint = tf.train.Checkpoint(
            values={key: variable.value for key, variable in variables.items()}
        )
        # Every asked-for value must be in the checkpoint (the caller checked the manifest);
        # the meta record and anything the caller chose not to restore are left unread.
        with self._damaged_as(step):
            status = checkpoint.restore(self._path(step))
            status.expect_partial()
            status.assert_existing_objects_matched()

    def delete(self, step: int) -> None:
        for path in tf.io.gfile.glob(f"{self._path(step)}.*"):
            _remove(path)

    def delete_all(self) -> None:
        """Every process calls this; the chief deletes (the others' scratch copies go when
        the engine closes)."""
        self.wait()
        if self._scratch is not None:
            return
        # The checkpoints, and the `ckpt-N_temp` directory of a save that a kill interrupted.
        for path in tf.io.gfile.glob(os.path.join(self.directory, f"{PREFIX}-*")):
            _remove(path)
        state_file = os.path.join(self.directory, "checkpoint")
        if tf.io.gfile.exists(state_file):
            tf.io.gfile.remove(state_file)

    def close(self) -> None:
        self.wait()
        if self._scratch is not None:
            _remove(self._scratch)


def _remove(path: str) -> None:
    if tf.io.gfile.isdir(path):
        tf.io.gfile.rmtree(path)
    else:
        tf.io.gfile.remove(path)
