"""Checkpoints on the object stores an engine cannot write itself (Orbax and tf.train on
`s3://`, and any other scheme fsspec has), staged on the local disk and uploaded.

Layout: checkpoint `N` is the prefix `<backup_dir>/<tag>-N/` (`orbax-N`, `tf-N`) holding the
files the engine wrote for it in a local directory, under the same relative names, and the
commit marker `<tag>-N/COMMITTED`, written last.

- **Saving.** The engine writes the step into a local staging directory (a tempdir of this
  process) as it writes a local path: the state leaves the devices before `save` returns,
  the files are written in the background. A thread of this engine waits for them, uploads
  them while training goes on and, once every file is in the bucket, writes the marker (the
  list of files with their sizes and CRC32Cs, `keras_accel.state.checksums`) in one
  request. One save is in flight at a time: the next one first waits for the upload before
  it.
- **Atomic commit.** Only prefixes with their marker are listed by `steps()`. A process
  killed while uploading leaves a prefix without one: found when an engine opens the
  directory (`interrupted`) and removed by the chief. Deleting a checkpoint removes its
  marker first, so a deletion that a kill interrupts leaves nothing that looks complete.
- **Rotation.** Once a step is committed, the chief removes the oldest beyond `max_to_keep`,
  whole prefixes. The staging directory keeps one step (the engine's own rotation); that of
  a killed process is removed by the next engine opened on the host.
- **Restoring.** The step's objects are downloaded into a local tempdir in the engine's
  layout, each checked against the size and CRC32C its marker lists (a damaged one is
  `checksums.Damaged`, before the engine reads anything), and an engine opened there reads
  them (the record, then the arrays).
- **Processes.** tf.train's chief writes the checkpoint (the other workers write scratch
  copies, as on a local path) and uploads it. Orbax shards a save over the processes, and
  its primary host writes the metadata into a directory all of them see, which staging
  directories are not: there each process is its own primary host (`per_process`, each
  shard a file of its own), uploads its files under `<tag>-N/process-K/` (the chief: under
  `<tag>-N/`) and tells the chief through the JAX coordination service what it sent; the
  chief writes the marker once every process has. A restore downloads the step whole into
  one directory: the chief's files, then each other process's that the chief has not
  (its shards; the metadata every process wrote is the chief's).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading

from keras_accel.state import checksums, files
from keras_accel.utils import process

MARKER = "COMMITTED"
_PROCESS = re.compile(r"^process-\d+$")  # A process's own files in a step's prefix.
_SAVES: dict[str, int] = {}  # A step's prefix -> how many times this process saved it.
_WAIT_S = 600  # How long the chief waits for another process's upload: a dead one fails it.
_STAGING = "keras_accel-staging-"  # + pid: a killed process's directory is found and removed.


def supports(path: str) -> bool:
    """Whether fsspec has a file system for `path`'s scheme (packages such as s3fs present)."""
    import fsspec

    kind = files.scheme(path)
    if kind not in fsspec.available_protocols():
        return False
    try:
        fsspec.get_filesystem_class(kind)
    except (ImportError, ValueError):
        return False
    return True


class Engine:
    """An engine module's checkpoints at a URL it cannot write, through a staging directory.

    `module` is the engine module (`orbax`, `tf_train`): its `Engine` writes and reads local
    directories, its `STAGED_TAG` names the prefixes, and its engines' `step_entries(step)`
    name what one step wrote in their directory.
    """

    def __init__(
        self,
        module,
        directory: str,
        max_to_keep: int,
        asynchronous: bool,
        signing_key: bytes | None = None,
    ):
        """`signing_key`: the marker is signed (`checksums.sign`, over the step and every
        file it lists, the engine's metadata included), and a restore refuses a step whose
        marker is unsigned or does not verify. Only listed files are downloaded, so a file
        added to a prefix is never read."""
        self.module = module
        self._key = signing_key
        self.name = module.NAME
        self.directory = directory.rstrip("/")
        self.max_to_keep = max_to_keep
        self.asynchronous = asynchronous
        self._tag = module.STAGED_TAG
        self._number = re.compile(rf"^{re.escape(self._tag)}-(\d+)$")
        _remove_orphans()
        self._staging = tempfile.mkdtemp(prefix=f"{_STAGING}{os.getpid()}-")
        # Each process stages its own shards (the engine's own protocol needs a shared
        # directory): see the module's docstring.
        self._per_process = getattr(module, "STAGED_PER_PROCESS", False)
        self._per_process = self._per_process and process.num_processes() > 1
        self._options = {"per_process": True} if self._per_process else {}
        if getattr(module, "RECORDS", False):
            # The marker records every file; the engine's own record would be a second pass.
            self._options["record"] = False
        # The staging engine keeps one step: the upload of the one before it is done before
        # the next save begins (and the staging engine is used by one thread at a time).
        self._local = module.Engine(self._staging, 1, asynchronous=asynchronous, **self._options)
        self._upload: tuple[int, threading.Thread, list] | None = None
        self._fetched: dict[int, tuple[str, object]] = {}  # step -> (tempdir, reader engine)
        # Saves a kill interrupted: a prefix without its marker. The chief removes them.
        self.interrupted = sorted(step for step, done in self._listed().items() if not done)
        if self.interrupted and process.is_chief():
            for step in self.interrupted:
                _remove_tree(self.path(step))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, variables: dict, meta: dict) -> None:
        self.wait()
        self._local.save(step, variables, meta)
        key = None
        if self._per_process:
            # Every process saves the same steps in the same order: how many times this
            # one saved step N of this directory names the save, the same everywhere.
            count = _SAVES[self.path(step)] = _SAVES.get(self.path(step), 0) + 1
            key = f"keras_accel/staged/{self.path(step)}/{count}"
        if not self.asynchronous:
            self._local.wait()
            self._send(step, key)
            return
        failure: list = []

        def upload():
            try:
                # The engine's own background write first (the state left the devices
                # before `save` returned), then the upload, off the training thread.
                self._local.wait()
                self._send(step, key)
            except BaseException as error:  # Raised by `wait`, in the training thread.
                failure.append(error)

        thread = threading.Thread(target=upload, name="keras_accel-upload")
        thread.start()
        self._upload = (step, thread, failure)

    def _send(self, step: int, key: str | None) -> None:
        """This process's part of committing step `step` (`key`: a per-process save's name
        in the coordination service)."""
        entries = self._local.step_entries(step)
        if key is None:
            if process.is_chief():  # tf.train's other workers write a scratch copy.
                self._commit(step, entries)
            return
        client = process.coordination_client()
        me = process.process_index()
        if me != 0:
            # Whatever happens here, the chief hears it (it waits for every process).
            try:
                sizes, crcs, shas = self._upload_files(step, entries, f"process-{me}")
            except BaseException as error:
                client.key_value_set(f"{key}/{me}", json.dumps({"error": repr(error)}), True)
                raise
            told = {"files": sizes, checksums.ALGORITHM: crcs, checksums.STRONG: shas}
            client.key_value_set(f"{key}/{me}", json.dumps(told), True)
            return
        self._commit(step, entries, key)

    def _upload_files(
        self, step: int, entries: list[str], under: str = ""
    ) -> tuple[dict[str, int], dict[str, str], dict[str, str]]:
        """Upload step `step`'s local files (under the step's prefix, in `under` there):
        ({their names in the prefix: sizes}, {names: CRC32Cs}, {names: SHA-256s, with a
        signing key}), read from the local files before they leave (this is the upload
        thread, not the training thread)."""
        target = self.path(step)
        sizes, crcs, shas = {}, {}, {}
        for entry in entries:
            for relative in _walk(self._staging, entry):
                local = os.path.join(self._staging, relative)
                name = "/".join(([under] if under else []) + relative.split(os.sep))
                digest = checksums.digest(local, strong=self._key is not None)
                files.upload(local, files.join(target, *name.split("/")))
                sizes[name], crcs[name] = digest["size"], digest[checksums.ALGORITHM]
                if checksums.STRONG in digest:
                    shas[name] = digest[checksums.STRONG]
        return sizes, crcs, shas

    def _commit(self, step: int, entries: list[str], key: str | None = None) -> None:
        """Upload step `step`'s local files, then (with `key`: once every other process said
        it uploaded its own) its marker; on failure remove what was sent."""
        target = self.path(step)
        client = process.coordination_client() if key else None
        try:
            sizes, crcs, shas = self._upload_files(step, entries)
            for other in range(1, process.num_processes()) if key else ():
                told = json.loads(client.blocking_key_value_get(f"{key}/{other}", _WAIT_S * 1000))
                # Read once: the coordination service keeps no more than a save in flight.
                client.key_value_delete(f"{key}/{other}")
                if "error" in told:
                    raise RuntimeError(
                        f"Process {other} could not upload its part of the backup of step "
                        f"{step} to {target!r}: {told['error']}"
                    )
                sizes.update(told["files"])
                crcs.update(told.get(checksums.ALGORITHM, {}))
                shas.update(told.get(checksums.STRONG, {}))
            marker = {"files": sizes, checksums.ALGORITHM: crcs}
            if self._key is not None:
                marker[checksums.STRONG] = shas
                marker[checksums.SIGNATURE] = checksums.sign(
                    self._key, step, _entries(sizes, crcs, shas)
                )
            files.write_atomic(files.join(target, MARKER), json.dumps(marker))
        except BaseException:
            _remove_tree(target)
            raise
        self._rotate()

    def wait(self) -> None:
        upload, self._upload = self._upload, None
        if upload is None:
            return
        _, thread, failure = upload
        thread.join()
        if failure:
            raise failure[0]

    def _rotate(self) -> None:
        steps = self._steps()
        for step in steps[: max(0, len(steps) - self.max_to_keep)]:
            self._delete(step)

    # ------------------------------------------------------------------ listing
    def _listed(self) -> dict[int, bool]:
        """{step: committed} for every `<tag>-N` prefix in the directory."""
        return files.numbered(
            self.directory, self._number, lambda step: files.join(self.path(step), MARKER)
        )

    def _steps(self) -> list[int]:
        return sorted(step for step, done in self._listed().items() if done)

    def steps(self) -> list[int]:
        self.wait()  # A save in flight is listed once committed.
        return self._steps()[-self.max_to_keep :]

    def has(self, step: int) -> bool:
        return step in self.steps()

    def path(self, step: int) -> str:
        return files.join(self.directory, f"{self._tag}-{int(step)}")

    def files(self, step: int) -> tuple[str, str]:
        """(the largest file of checkpoint `step`, its commit marker)."""
        path = self.path(step)
        marker = files.join(path, MARKER)
        try:
            sizes = json.loads(files.read_text(marker))["files"]
        except (OSError, ValueError, KeyError):
            return path, marker
        largest = max(sizes, key=sizes.get) if sizes else None
        return (files.join(path, *largest.split("/")) if largest else path), marker

    # ------------------------------------------------------------------ reading
    def _reader(self, step: int):
        """A local engine on a download of checkpoint `step` (kept until `close`)."""
        if step not in self._fetched:
            local = tempfile.mkdtemp(prefix="keras_accel-restore-")
            try:
                path = self.path(step)
                marker = self._marker(step)
                listed, crcs = marker["files"], marker.get(checksums.ALGORITHM)
                shas = marker.get(checksums.STRONG) or {}
                if self._key is not None:
                    signed = {checksums.SIGNATURE: marker.get(checksums.SIGNATURE)}
                    signed["files"] = _entries(listed, crcs or {}, shas)
                    checksums.authenticate(signed, self._key, step, MARKER)
                # The chief's files first: a file that other processes wrote too (the
                # step's metadata) is the chief's; their own (shards) are added.
                for name in sorted(listed, key=lambda name: name.startswith("process-")):
                    parts = name.split("/")
                    if _PROCESS.match(parts[0]):
                        parts = parts[1:]
                    target = os.path.join(local, *parts)
                    if os.path.exists(target):
                        continue
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    try:
                        with files.local_copy(files.join(path, name)) as copy:
                            shutil.copyfile(copy, target)
                    except FileNotFoundError as error:
                        raise checksums.Damaged(name, "missing") from error
                    # Checked on the local copy: the download is read once more, from the
                    # page cache, instead of a second download. Markers written before
                    # CRC32Cs were recorded have the sizes alone.
                    expected = {"size": listed[name], checksums.ALGORITHM: (crcs or {}).get(name)}
                    if self._key is not None:  # What the signature covers.
                        expected[checksums.STRONG] = shas.get(name)
                    checksums.check(target, name, expected)
                reader = self.module.Engine(local, 1, asynchronous=False, **self._options)
            except BaseException:
                shutil.rmtree(local, ignore_errors=True)
                raise
            self._fetched[step] = (local, reader)
        return self._fetched[step][1]

    def _marker(self, step: int) -> dict:
        try:
            text = files.read_text(files.join(self.path(step), MARKER))
        except FileNotFoundError as error:
            raise checksums.Damaged(MARKER, "missing") from error
        try:
            marker = json.loads(text)
            marker["files"].items()  # noqa: B018 - the shape is what is checked.
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise checksums.Damaged(MARKER, f"unreadable ({type(error).__name__})") from error
        return marker

    def verify(self, step: int) -> bool:
        """Download step `step` and check every file against its marker (kept for the
        restore that follows): False where the marker records sizes only.

        Raises:
            checksums.Damaged: a file differs from the marker, or is gone.
        """
        self._reader(step)
        return checksums.ALGORITHM in self._marker(step)

    def set_aside(self, step: int) -> str:
        """Move the damaged step `step` to `damaged/` (the chief; kept, never listed
        again); returns where it is now."""
        fetched = self._fetched.pop(step, None)
        if fetched is not None:
            fetched[1].close()
            shutil.rmtree(fetched[0], ignore_errors=True)
        target = checksums.aside(self.directory, f"{self._tag}-{int(step)}")
        if process.is_chief():
            files.move(self.path(step), target)
        return target

    def read_meta(self, step: int) -> dict:
        return self._reader(step).read_meta(step)

    def restore(self, step: int, variables: dict, manifest: dict) -> None:
        self._reader(step).restore(step, variables, manifest)

    # ------------------------------------------------------------------ deleting
    def _delete(self, step: int) -> None:
        path = self.path(step)
        marker = files.join(path, MARKER)
        if files.exists(marker):
            files.remove(marker)  # No longer listed, whatever happens next.
        _remove_tree(path)

    def delete(self, step: int) -> None:
        """Every process calls this; the chief deletes."""
        self.wait()
        if process.is_chief():
            self._delete(step)

    def delete_all(self) -> None:
        self.wait()
        if process.is_chief():
            for step in sorted(self._listed()):
                self._delete(step)

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for local, reader in self._fetched.values():
                reader.close()
                shutil.rmtree(local, ignore_errors=True)
            self._fetched.clear()
            self._local.close()
            shutil.rmtree(self._staging, ignore_errors=True)


def _entries(sizes: dict, crcs: dict, shas: dict) -> dict:
    """A marker's files as a signed record's entries (`{name: {"size", "crc32c",
    "sha256"}}`): what the marker's signature covers."""
    return {
        name: {"size": size, checksums.ALGORITHM: crcs.get(name), checksums.STRONG: shas.get(name)}
        for name, size in sizes.items()
    }


def _remove_orphans() -> None:
    """Remove the staging directories of this host's processes that are gone (a SIGKILL
    skips every cleanup): each holds a step of training state."""
    root = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            pid = name[len(_STAGING) :].split("-", 1)[0]
            if name.startswith(_STAGING) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # Alive, another user's (PermissionError), or unknowable: keep it.
        return True
    return True


def _walk(root: str, entry: str) -> list[str]:
    """The files under `root/entry` (itself, if a file), relative to `root`, sorted."""
    top = os.path.join(root, entry)
    if not os.path.isdir(top):
        return [entry]
    found = []
    for folder, _, names in os.walk(top):
        found += [os.path.relpath(os.path.join(folder, name), root) for name in names]
    return sorted(found)


def _remove_tree(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # Gone already, or never more than a prefix.
        files.rmtree(path)
