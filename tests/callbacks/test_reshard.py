"""State that reshards: a backup made under one layout restores bit-exact under another.

BackupAndRestore saves each array as it lies (under `fsdp` every device writes its own
shards; nothing is gathered on one host) and restores each into the layout the new run's
variable has. Each run is its own process, since a process's device count is fixed:
JAX goes fsdp on 8 devices -> fsdp on 4 -> one device -> data_parallel on 8 -> fsdp on 8;
TensorFlow (tf.train) data_parallel on 8 -> one device -> data_parallel on 4; and JAX's
fsdp over 2 processes x 4 devices -> one process of 8. At each hop the
restored weights and optimizer slots equal the saved ones bit for bit, and one more epoch
from them then trains as the same epoch would under the old layout.
"""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

SCRIPT = pathlib.Path(__file__).with_name("_reshard_script.py")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def build():
    init = keras.initializers.GlorotUniform(seed=0)
    model = keras.Sequential(
        [
            keras.Input((6,)),
            # No bias before BatchNormalization: its gradient is rounding noise, which Adam scales
            # up to the step size (so runs under two layouts would part there).
            keras.layers.Dense(32, use_bias=False, kernel_initializer=init, name="wide"),
            keras.layers.BatchNormalization(name="norm"),
            keras.layers.Activation("relu"),
            keras.layers.Dense(3, "softmax", kernel_initializer=init, name="classes"),
        ],
        name="net",
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="sparse_categorical_crossentropy")
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(37, 6)).astype("float32")  # Uneven: 3 batches of 16, one padded.
    return x, (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")


def state(model) -> dict:
    """Every weight and optimizer variable by path, as numpy."""
    variables = [*model.weights, *model.optimizer.variables]
    return {v.path.replace("/", "|"): np.asarray(v) for v in variables}


def _run(workdir, devices, strategy, epochs, name, backup="backup"):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            str(workdir),
            backup,
            str(devices),
            strategy,
            str(epochs),
            name,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    layout = (workdir / f"{name}.layout").read_text()
    return dict(np.load(workdir / f"{name}.npz")), layout


def _assert_equal(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@pytest.mark.slow
def test_a_backup_restores_bit_exact_onto_other_layouts(tmp_path, backend):
    if backend == "jax":
        hops = [(4, "fsdp"), (1, "single"), (8, "data_parallel"), (8, "fsdp")]
        first, layouts = (8, "fsdp"), {"fsdp": "P(None, 'batch')", "single": "one device"}
    else:
        # 2 replicas first, then 1 and 4: TensorFlow traces every step once per replica,
        # and each run is a new process (51 s against 71 s with 8 first, measured alone).
        hops = [(1, "single"), (4, "data_parallel")]
        first, layouts = (2, "data_parallel"), {}
    saved, layout = _run(tmp_path, *first, epochs=2, name="saved")
    if first[1] in layouts:  # JAX's arrays say their layout; tf.train's have none to say.
        assert layout == layouts[first[1]]
    for i, (devices, strategy) in enumerate(hops):
        # Two epochs asked, two in the backup: the run restores and trains nothing more.
        restored, layout = _run(tmp_path, devices, strategy, epochs=2, name=f"hop{i}")
        _assert_equal(restored, saved)
        if strategy in layouts:
            assert layout == layouts[strategy], (strategy, layout)
    # One more epoch from a restore onto one device (JAX) or 4 replicas (TF), against the
    # same three epochs uninterrupted under the first layout: equal within float rounding.
    later, _ = _run(tmp_path, *hops[1 if backend == "jax" else -1], epochs=3, name="later")
    reference, _ = _run(tmp_path, *first, epochs=3, name="reference", backup="fresh")
    assert any(not np.array_equal(later[k], saved[k]) for k in saved)  # It trained on.
    for key in reference:
        np.testing.assert_allclose(later[key], reference[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow
def test_a_backup_of_two_processes_restores_onto_one(tmp_path, backend):
    """fsdp over 2 processes x 4 devices (`keras-accel launch`: each process writes its own
    shards) restores bit-exact onto one process of 8, under fsdp and under data_parallel."""
    if backend != "jax":
        pytest.skip("JAX's processes: TF's multi-worker backups are tests/distributed's")
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    command += ["--devices-per-process", "4", str(SCRIPT), str(tmp_path), "backup", "4"]
    done = subprocess.run(
        [*command, "fsdp", "2", "saved"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    saved = dict(np.load(tmp_path / "saved.npz"))
    assert (tmp_path / "saved.layout").read_text() == "P(None, 'batch')"
    for i, strategy in enumerate(("fsdp", "data_parallel")):
        restored, _ = _run(tmp_path, 8, strategy, epochs=2, name=f"one{i}")
        _assert_equal(restored, saved)


def test_fsdp_to_data_parallel_in_one_session(tmp_path, backend, num_devices):
    """A notebook's reshard: fsdp, then the model built again in the same Python session
    under data_parallel (Keras names its optimizer `adam_1` there, where the backup says
    `adam`), resumed from the backup bit for bit; no lock of the first fit in the way."""
    if backend != "jax" or num_devices < 2:
        pytest.skip("fsdp is JAX's, over several devices")
    from keras_accel import Accelerator
    from keras_accel.callbacks import BackupAndRestore

    x, y = data()
    directory = str(tmp_path / "backup")
    fsdp = Accelerator(strategy="fsdp", seed=0)
    with fsdp.scope():
        first = build()
    backup = BackupAndRestore(directory, delete_checkpoint=False)
    fsdp.fit(first, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    saved = state(first)
    parallel = Accelerator(strategy="data_parallel", seed=0)
    with parallel.scope():
        again = build()
    assert again.optimizer.name != first.optimizer.name  # adam_1: Keras numbered it on.
    backup = BackupAndRestore(directory, delete_checkpoint=False)
    # Two epochs asked, two in the backup: it restores and trains nothing more.
    parallel.fit(again, x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    restored = {
        v.path.replace("/", "|"): np.asarray(v)
        for v in [*again.weights, *again.optimizer.variables]
    }
    assert len(restored) == len(saved)
    for (_, want), (_, got) in zip(saved.items(), restored.items(), strict=True):
        np.testing.assert_array_equal(got, want)
