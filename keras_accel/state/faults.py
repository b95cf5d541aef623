"""What `BackupAndRestore` says when a backup cannot be written or is found damaged: one
wording on every engine and store, naming the directory, the step, the cause and what is
still intact.

Each engine fails in its own words (Orbax: `ValueError: RESOURCE_EXHAUSTED: Error writing
... in OCDBT database`; tf.train: `ResourceExhaustedError: ... No space left on device
[Op:SaveV2]`; DCP: `OSError: [Errno 28]`; an object store: its HTTP error); the user needs
the same four facts from each, and the engine's own words after them.
"""

from __future__ import annotations

import errno

# The cause of a failed write, found in the error or anything it was raised from: the
# error numbers first, then the words the engines and stores use.
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
_NO_SPACE_WORDS = (
    "no space left",
    "resource_exhausted",
    "os_error_code='28'",
    "disk quota exceeded",
    "quotaexceeded",
    "entitytoolarge",
)
_NO_PERMISSION_WORDS = (
    "permission denied",
    "permission_denied",
    "accessdenied",
    "access denied",
    "forbidden",
    "read-only file system",
    "os_error_code='13'",
)
_DETAIL = 400  # Characters of the engine's own message kept (Orbax's run to pages).


def _chain(error: BaseException) -> list[BaseException]:
    """`error` and everything it was raised from or during, and the failures a DCP
    `CheckpointException` collected from its processes."""
    seen, todo = [], [error]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is s for s in seen):
            continue
        seen.append(current)
        todo += [current.__cause__, current.__context__]
        for _, (failure, *_rest) in sorted(getattr(current, "failures", {}).items()):
            if isinstance(failure, BaseException):
                todo.append(failure)
    return seen


def cause_of(error: BaseException, remote: bool) -> tuple[str, str, int | None]:
    """(the cause in words, what fixes it, the error number) of a failed write."""
    chain = _chain(error)
    numbers = [e.errno for e in chain if isinstance(e, OSError) and e.errno is not None]
    text = " ".join(f"{type(e).__name__}: {e}" for e in chain).lower()
    if any(n in _NO_SPACE for n in numbers) or any(w in text for w in _NO_SPACE_WORDS):
        return "no space left on the device", "there is space again", errno.ENOSPC
    if (
        any(n in _NO_PERMISSION for n in numbers)
        or any(isinstance(e, PermissionError) for e in chain)
        or any(w in text for w in _NO_PERMISSION_WORDS)
    ):
        return "permission denied", "the directory is writable again", errno.EACCES
    if remote:
        return "the store refused the write", "the store takes writes again", None
    return "the file system's error", "the file system takes writes again", None


def write_error(
    backup_dir: str, step: int | None, error: BaseException, intact: list[int] | None, path_of
) -> OSError:
    """The error a failed save raises: the directory, the step, the cause, the newest
    intact backup (`intact`: the committed steps, None where they could not be listed;
    `path_of(step)` its path), and the engine's own message."""
    from keras_accel.state import files

    cause, remedy, number = cause_of(error, files.is_remote(backup_dir))
    which = "a backup" if step is None else f"the backup of step {step}"
    detail = f"{type(error).__name__}: {error}"
    if len(detail) > _DETAIL:
        detail = detail[: _DETAIL - 3] + "..."
    if intact is None:
        then = f"Run the same fit again, once {remedy}, to resume from the newest intact backup."
    elif intact:
        then = (
            f"The newest intact backup is step {intact[-1]} ({path_of(intact[-1])}): run the "
            f"same fit again, once {remedy}, to resume from it."
        )
    else:
        then = (
            f"No earlier backup is intact: run again, once {remedy}, the same fit starts "
            "from the beginning."
        )
    failure = OSError(
        f"BackupAndRestore: could not write {which} to {backup_dir!r}: {cause} ({detail}). "
        f"Nothing of it is left that a later run could take for a backup. {then}"
    )
    failure.errno = number  # Where the cause has one, for code that tells causes apart.
    return failure


def damaged_warning(
    backup_dir: str, step: int, damage, where: str | None, why_not_moved: str, intact: int
) -> str:
    """The warning for a damaged step passed over for the intact step `intact`; `where` it
    is kept now (None: it could not be moved, `why_not_moved` says why)."""
    kept = (
        f"It is kept as {where!r}, never resumed from or counted as the latest again"
        if where is not None
        else f"It could not be set aside ({why_not_moved}): move it away by hand"
    )
    state = "refused as tampered" if getattr(damage, "tampered", False) else "damaged"
    return (
        f"BackupAndRestore: the backup of step {step} in {backup_dir!r} is {state}: "
        f"{damage.file}: {damage.mismatch}. {kept}. Resuming from step {intact}, the newest "
        "intact backup."
    )


def none_intact_error(backup_dir: str, found: list[tuple[int, str, str]]) -> RuntimeError:
    """The error where no backup can be restored: `found` is (step, path, why) of each."""
    each = "; ".join(f"step {step} ({path}): {why}" for step, path, why in found)
    return RuntimeError(
        f"BackupAndRestore: no backup in {backup_dir!r} is intact: {each}. They were left "
        "as they are: move them away to start training from scratch, or restore a copy of "
        "the directory."
    )
