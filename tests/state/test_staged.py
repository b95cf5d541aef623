"""Backups on object stores, against local servers (moto's S3 and a GCS emulator,
tests/object_stores.py): on s3:// Orbax and tf.train staged through the local disk and
uploaded with a commit marker (keras_accel/state/staged.py), DCP through s3fs; saves a kill
interrupted, named and removed, on s3:// and gs://."""

import os

import keras
import numpy as np
import pytest

from keras_accel.callbacks import BackupAndRestore
from keras_accel.state import files
from tests.gcs_emulator import gcs_like_google  # noqa: F401 (a fixture, for gs://)

pytestmark = pytest.mark.torch  # Also on KERAS_BACKEND=torch (DCP writes s3:// itself).

# What one committed step is in the bucket, and the object whose absence means "never
# committed": staged prefixes and their marker, DCP's directories and its `.metadata`.
LAYOUT = {
    "jax": ("orbax-{}", "COMMITTED"),
    "tensorflow": ("tf-{}", "COMMITTED"),
    "torch": ("dcp-{}", ".metadata"),
}


def _model():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(3, kernel_initializer=keras.initializers.Ones())]
    )
    model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 3)).astype("float32")


class _StopAt(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("stopped")


class _Listing(keras.callbacks.Callback):
    """The bucket's listing once the callbacks before this one began training (restored)."""

    def __init__(self, url):
        super().__init__()
        self.url, self.names = url, None

    def on_train_begin(self, logs=None):
        self.names = files.listdir(self.url)


def test_a_backup_on_s3_commits_rotates_and_resumes(s3_bucket, backend):
    url = f"{s3_bucket}/run"
    step, marker = LAYOUT[backend]
    x, y = _data()
    model = _model()
    backup = BackupAndRestore(url, save_freq=2, max_to_keep=2)
    with pytest.raises(RuntimeError, match="stopped"):
        model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[backup, _StopAt(2)])
    backup.wait()  # The last upload, still in flight when the exception ended fit.
    # 4 batches an epoch, a backup every 2: steps 2, 4, 6, 8, the newest 2 kept, committed.
    assert sorted(n for n in files.listdir(url) if n != ".lock") == [
        step.format(6),
        step.format(8),
    ]
    for number in (6, 8):
        assert files.exists(f"{url}/{step.format(number)}/{marker}")
    expected = [np.asarray(w) for w in model.get_weights()]

    resumed = _model()
    history = resumed.fit(
        x, y, batch_size=8, epochs=2, verbose=0, callbacks=[BackupAndRestore(url)]
    )
    assert history.epoch == []  # Both epochs were done before the stop: nothing to train.
    for got, want in zip(resumed.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(np.asarray(got), want)
    assert not files.exists(url)  # Deleted once training completed.


# On gs:// Orbax writes step N in place, committed by N/commit_success.txt (no staging), and
# DCP as on s3://. TensorFlow's own GCS client has its endpoint compiled in: no emulator
# reaches it.
GS_LAYOUT = {"jax": ("{}", "commit_success.txt"), "torch": ("dcp-{}", ".metadata")}


@pytest.mark.parametrize("store", ["s3", "gs"])
def test_an_interrupted_save_on_an_object_store_is_named_and_removed(request, store, backend):
    if store == "gs" and backend not in GS_LAYOUT:
        pytest.skip(f"no gs:// emulator run for {backend}'s engine (see GS_LAYOUT)")
    if store == "gs":
        request.getfixturevalue("gcs_like_google")
    bucket = request.getfixturevalue({"s3": "s3_bucket", "gs": "gcs_bucket"}[store])
    url = f"{bucket}/run"
    step, marker = (LAYOUT if store == "s3" else GS_LAYOUT)[backend]
    x, y = _data()
    first = BackupAndRestore(url, save_freq=2, delete_checkpoint=False, save_on_background=False)
    _model().fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[first])
    # A process killed while writing step 4: its objects are there, its commit never came.
    files.remove(f"{url}/{step.format(4)}/{marker}")
    listing = _Listing(url)
    with pytest.warns(UserWarning, match=r"the backup of step 4 in .* was still being written"):
        history = _model().fit(
            x, y, batch_size=8, epochs=1, verbose=0, callbacks=[BackupAndRestore(url), listing]
        )
    assert step.format(4) not in listing.names, listing.names  # Its objects removed...
    assert step.format(2) in listing.names
    assert history.epoch == [0]  # ...and the epoch resumed from step 2, its batch 2.


def test_orbax_names_steps_written_in_place_without_their_commit(s3_bucket):
    """On gs:// Orbax writes step N in place and commits it with N/commit_success.txt; the
    same layout on another object store is read by the same code."""
    orbax = pytest.importorskip("keras_accel.state.engines.orbax")
    for name in (
        "3/commit_success.txt",
        "3/state/data",
        "5/state/data",
        "7.orbax-checkpoint-tmp-1/x",
    ):
        files.write_atomic(f"{s3_bucket}/run/{name}", b"x")
    assert orbax._interrupted(f"{s3_bucket}/run") == {5: "5", 7: "7.orbax-checkpoint-tmp-1"}


def test_staged_backups_of_another_backend_are_refused_with_what_they_are(tmp_path, backend):
    other, wrote = ("tf-3", "tf.train") if backend == "jax" else ("orbax-3", "Orbax")
    (tmp_path / other).mkdir()
    (tmp_path / other / "COMMITTED").write_text("{}")
    x, y = _data()
    with pytest.raises(RuntimeError, match=rf"holds {wrote} checkpoints \({other[:-2]}-<step>"):
        _model().fit(x, y, epochs=1, verbose=0, callbacks=[BackupAndRestore(str(tmp_path))])


def test_the_staging_directory_of_a_killed_process_is_removed(backend):
    if backend == "torch":
        pytest.skip("DCP writes object stores itself: nothing is staged on torch")
    import subprocess
    import sys
    import tempfile
    import uuid

    from keras_accel.state import engines

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    orphan = tempfile.mkdtemp(prefix=f"keras_accel-staging-{int(gone.stdout)}-")
    engine = engines.open_engine(backend, f"memory://staged-{uuid.uuid4().hex[:8]}/run", 1, True)
    try:
        assert not os.path.exists(orphan)
        assert os.path.isdir(engine._staging)  # Its own, of a live process, stays.
    finally:
        engine.close()
    assert not os.path.exists(engine._staging)


def test_a_signed_backup_on_s3_restores_and_an_unsigned_marker_is_refused(s3_bucket, backend):
    import json

    from keras_accel.state import checksums

    url = f"{s3_bucket}/signed"
    step, marker = LAYOUT[backend]
    record = "COMMITTED" if marker == "COMMITTED" else checksums.RECORD
    x, y = _data()
    key = b"staged signing key"
    model = _model()
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=2,
        verbose=0,
        callbacks=[BackupAndRestore(url, delete_checkpoint=False, signing_key=key)],
    )
    # Signed: every file's SHA-256, and the HMAC (staged markers and DCP's record alike).
    newest = f"{url}/{step.format(8)}/{record}"
    signed = json.loads(files.read_text(newest))
    assert checksums.SIGNATURE in signed
    del signed[checksums.SIGNATURE]  # Re-written by someone without the key.
    files.write_atomic(newest, json.dumps(signed))
    with pytest.warns(UserWarning, match="refused as tampered") as caught:
        history = _model().fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[BackupAndRestore(url, signing_key=key)],
        )
    (warning,) = [str(w.message) for w in caught if "tampered" in str(w.message)]
    assert f"the backup of step 8 in {url!r} is refused as tampered: {record}: unsigned" in warning
    assert warning.endswith("Resuming from step 4, the newest intact backup."), warning
    assert history.epoch == [1, 2]  # From step 4 (epoch 1 done), not step 8.
