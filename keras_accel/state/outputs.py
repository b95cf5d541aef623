"""Files a user names as an output (bench reports and plots, History's logs and plot, model
files), written whole to a local path or to any URL fsspec opens, through `state.files`.

A local path gets its missing parent directories, as on any disk. A URL gets none: object
stores have no directories, and "creating" the parent of `s3://my-bukcet/run/bench.json`
would create the mistyped bucket (s3fs and gcsfs make a bucket when asked for a bare bucket
name), where the write should fail with the store's own error.

Example:

>>> from keras_accel.state import files, outputs
>>> outputs.write("memory://outputs-doc/run/report.json", '{"ok": true}')
>>> files.read_text("memory://outputs-doc/run/report.json")
'{"ok": true}'
>>> files.rmtree("memory://outputs-doc")
"""

from __future__ import annotations

import io
import os

from keras_accel.state import files

# Schemes whose first path component is a bucket (container) that must exist beforehand.
BUCKET_SCHEMES = ("gs", "gcs", "s3", "s3a", "az", "abfs", "abfss")


def prepare_parent(path: str) -> None:
    """Create the missing parent directories of the local file `path`; nothing for a URL.

    Raises:
        FileExistsError: a parent of a local `path` is a file.
    """
    if files.is_remote(path):
        return
    parent = files.dirname(files.local_path(path))
    if parent:
        files.makedirs(parent)


def write(path: str, data: bytes | str) -> None:
    """Write `data` to `path` (local or URL) whole: a reader finds the old file or the new
    one, never a part (`files.write_atomic`)."""
    path = os.fspath(path)
    prepare_parent(path)
    files.write_atomic(path, data)


def write_figure(path: str, figure, default_format: str = "png", **savefig) -> None:
    """Save the matplotlib `figure` to `path` (local or URL).

    Matplotlib writes local files only, so the figure is drawn into memory and written
    through `write`. The format follows the name's extension as `savefig(path)` would
    (`.png`, `.svg`, `.pdf`, ...), else `default_format`.
    """
    path = os.fspath(path)
    extension = os.path.splitext(files.basename(path))[1][1:].lower()
    buffer = io.BytesIO()
    figure.savefig(buffer, format=extension or default_format, **savefig)
    write(path, buffer.getvalue())


def check_writable(path: str) -> None:
    """Fail now, not after hours of work, on an output `path` that cannot be written.

    Local: the parent directories are created (a parent that is a file, or no permission,
    raises here) and `path` must not be a directory. URL: the protocol's package must be
    installed (files' error names it), `path` must not be a directory, and a bucket must
    exist. Credentials are checked as far as these reads check them.

    Raises:
        ValueError: the URL's protocol has no file system installed, or `path` is empty.
        IsADirectoryError: `path` is an existing directory.
        FileNotFoundError: the URL's bucket does not exist.
        OSError: a parent directory cannot be created, or the store refused the reads.
    """
    path = os.fspath(path)
    if not path.strip():
        raise ValueError(f"An output path cannot be empty. Received: {path!r}")
    prepare_parent(path)
    if files.isdir(path):
        raise IsADirectoryError(
            f"Cannot write {path!r}: it is an existing directory. Give a file name in it, "
            f"e.g. {files.join(path, 'out.json')!r}."
        )
    kind = files.scheme(path)
    if kind in BUCKET_SCHEMES:
        bucket = path.partition("://")[2].split("/", 1)[0]
        if not bucket or not files.exists(f"{kind}://{bucket}"):
            raise FileNotFoundError(
                f"Cannot write {path!r}: the bucket {bucket!r} does not exist (or these "
                f"credentials cannot see it). Create it first, e.g. `gcloud storage "
                f"buckets create` or `aws s3 mb`; keras_accel never creates buckets."
            )
