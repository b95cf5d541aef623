"""One shared distributed training run for the History and ModelCheckpoint tests.

Under TensorFlow a MirroredStrategy fit costs seconds, so the callbacks whose results are
read back from files share one `Accelerator.fit` on 8 replicas instead of one fit each.
"""

import types
import uuid

import keras
import numpy as np
import pytest

from keras_accel import Accelerator
from keras_accel.callbacks import History, ModelCheckpoint
from keras_accel.state import files
from tests.helpers import compiled_mlp, data

EPOCHS = 3
BATCH = 16
ROWS = 90  # 6 batches per epoch, the last one padded.


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    local = tmp_path_factory.mktemp("run")
    remote = f"memory://callbacks-{uuid.uuid4().hex[:8]}"
    acc = Accelerator(seed=0)
    with acc.scope():
        model = compiled_mlp(optimizer=keras.optimizers.Adam(0.01), dropout=True)
    x, y = data(ROWS)
    vx, vy = data(30, seed=1)
    history = History(path=str(local / "logs" / "history.json"), csv=True, per_step=True)
    checkpoints = {
        "remote_rotated": ModelCheckpoint(
            f"{remote}/ckpt/e{{epoch:02d}}.weights.h5", save_weights_only=True, max_to_keep=2
        ),
        "best": ModelCheckpoint(
            str(local / "best" / "e{epoch}-{val_loss:.3f}.keras"),
            save_best_only=True,
            monitor="val_loss",
        ),
        "last": ModelCheckpoint(str(local / "last.keras")),
        "steps": ModelCheckpoint(
            f"{remote}/steps/b{{epoch}}-{{batch}}.weights.h5",
            save_weights_only=True,
            save_freq=4,
            max_to_keep=3,
        ),
    }
    result = acc.fit(
        model,
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        validation_data=(vx, vy),
        verbose=0,
        callbacks=[history, *checkpoints.values()],
    )
    run = types.SimpleNamespace(
        acc=acc,
        model=model,
        weights=[np.asarray(w) for w in model.get_weights()],
        x=x,
        y=y,
        history=history,
        result=result,
        checkpoints=checkpoints,
        local=local,
        remote=remote,
        build=lambda: compiled_mlp(optimizer=keras.optimizers.Adam(0.01), dropout=True),
    )
    yield run
    if files.exists(remote):
        files.rmtree(remote)
