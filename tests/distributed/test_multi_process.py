"""The same script on several processes, for real: `keras-accel launch` on localhost.

JAX: 2 processes x 4 virtual CPU devices (jax.distributed, Gloo collectives) against one
process with 8. TensorFlow: 2 workers under MultiWorkerMirroredStrategy (a TF worker computes
on one CPU device) against one process with MirroredStrategy over 2. torch: 2 processes
(a gloo process group, one device each) against one process on the global batch. Same
global batch, same seed; the data (100 rows in batches of 16) splits unevenly, so the last
batch is padded.

Tolerances: TensorFlow's ring all-reduce of 2 values is the same sum as MirroredStrategy's
(measured: bit-equal); JAX's cross-process Gloo all-reduce adds the 8 shards in another order
than the in-process one: measured <= 1e-6 on these weights after 21 steps; 1e-5 allows for
the momentum's amplification on other machines. torch's processes each compute half the
gradient's rows and sum them, one matmul in one process: the same order of error, 1e-5.
Processes of one run, and a run resumed from its own backup, are compared exactly.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = pytest.mark.torch

SCRIPT = os.path.join(os.path.dirname(__file__), "_train.py")
FILES_SCRIPT = os.path.join(os.path.dirname(__file__), "_files.py")
PROCESSES = 2
LOCAL_DEVICES = {"jax": 8, "tensorflow": 2, "torch": 1}[BACKEND]  # The one-process reference.
TOLERANCE = 1e-6 if BACKEND == "tensorflow" else 1e-5
TIMEOUT_S = 300  # A launch takes 10-25 s here; a hang fails instead of stalling the suite.
# How long the launcher lets the processes save and exit after a SIGTERM before it SIGKILLs
# them. 5 s was too short on a loaded machine (load 7 on 2 cores, both backends' suites side
# by side): Orbax's save of the preemption backup was still being written, and the run
# ended in SIGKILL (137) instead of 143.
GRACE_S = 30


def _env():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return env


def _launch_command(workdir, *extra, script=SCRIPT, launcher=()):
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", str(PROCESSES)]
    command += ["--grace", str(GRACE_S), *launcher]
    if BACKEND == "jax":
        command += ["--devices-per-process", str(LOCAL_DEVICES // PROCESSES)]
    return [*command, script, str(workdir), *extra]


def launch(workdir, *extra, check=True, script=SCRIPT, launcher=()):
    os.makedirs(workdir, exist_ok=True)
    result = subprocess.run(
        _launch_command(workdir, *extra, script=script, launcher=launcher),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if check and result.returncode != 0:
        output = f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
        pytest.fail(f"launch failed ({result.returncode}):\n{output}")
    return result


def one_process(workdir, *extra, script=SCRIPT):
    os.makedirs(workdir, exist_ok=True)
    command = [sys.executable, script, str(workdir), "--devices", str(LOCAL_DEVICES), *extra]
    result = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def results(workdir, process=0):
    with np.load(os.path.join(workdir, f"result-{process}.npz")) as f:
        return dict(f)


def weights(result):
    return [result[k] for k in sorted(result, key=lambda k: (len(k), k)) if k.startswith("w")]


def assert_same(a, b, atol=0.0):
    for x, y in zip(weights(a), weights(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def backup_steps(workdir):
    names = os.listdir(os.path.join(workdir, "backup"))
    if BACKEND == "jax":
        return sorted(int(n) for n in names if n.isdigit())
    if BACKEND == "torch":  # Committed: DCP's index written (keras_accel.state.engines.torch_dcp).
        backup = os.path.join(workdir, "backup")
        return sorted(
            int(n[4:])
            for n in names
            if n.startswith("dcp-") and os.path.exists(os.path.join(backup, n, ".metadata"))
        )
    return sorted(int(n[5:-6]) for n in names if n.startswith("ckpt-") and n.endswith(".index"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("one-process")
    one_process(workdir)
    return results(workdir)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One uninterrupted 2-process run, then one more epoch with BackupAndRestore at its
    defaults (`--then-defaults`): its directory."""
    workdir = tmp_path_factory.mktemp("two-processes")
    launch(workdir, "--then-defaults")
    return workdir


def test_processes_agree_and_match_one_process(run, reference):
    first, second = results(run, 0), results(run, 1)
    for key in first:  # Weights, losses, evaluation and predictions: identical everywhere.
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert first["predictions"].shape == (100, 3)  # Every row, in order, on every process.
    assert_same(first, reference, TOLERANCE)
    np.testing.assert_allclose(first["loss"], reference["loss"], rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(first["evaluation"], reference["evaluation"], atol=TOLERANCE)
    np.testing.assert_allclose(first["predictions"], reference["predictions"], atol=10 * TOLERANCE)


@pytest.mark.skipif(BACKEND != "torch", reason="torch's process group")
def test_the_process_group_is_destroyed_at_exit(run):
    """Before the interpreter's teardown, which otherwise destroys gloo's threads while it
    frees what they hold and now and then aborts a process that has finished its work."""
    for process in range(PROCESSES):
        with open(run / f"exit-{process}.json") as f:
            assert json.load(f) == {"initialized": False}


def test_backup_and_restore_at_its_defaults_ends_on_every_process(run):
    """Deleting the backups at the end of fit is collective on Orbax (every process meets
    the others there): the chief alone reaching it hung the run, or failed with
    "sync_global_devices name mismatch". Every process ends its fit, and nothing is left."""
    assert sorted(p.name for p in run.glob("defaults-*.done")) == [
        f"defaults-{i}.done" for i in range(PROCESSES)
    ]
    assert not (run / "backup-defaults").exists()


def test_only_the_chief_writes(run):
    with open(os.path.join(run, "writes-0.txt")) as f:
        chief = f.read().split()
    assert os.path.join(str(run), "history.json") in chief
    assert os.path.join(str(run), "backup", ".lock") in chief
    assert os.path.join(str(run), "model-3.weights.h5") in chief
    # The other process saved the model too (reading the state may be a collective), but
    # into a scratch copy outside the run's directory.
    other = (run / "writes-1.txt").read_text().split() if (run / "writes-1.txt").exists() else []
    assert not [path for path in other if path.startswith(str(run))], other
    assert sorted(p.name for p in run.glob("model-*")) == [
        f"model-{e}.weights.h5" for e in (1, 2, 3)
    ]
    from keras_accel.callbacks import History

    assert History.load(os.path.join(run, "history.json")).epoch == [0, 1, 2]
    # The engine's own multi-host protocol wrote the backups (every 3 steps, 21 in all).
    assert backup_steps(run) == [9, 12, 15, 18, 21]


def test_restore_on_another_process_count(run, tmp_path):
    """Backups of 2 processes restore into 1 (the engine reads each array into the new
    layout): resumed from step 9 of 21, one process ends where the two did."""
    workdir = tmp_path / "resumed"
    shutil.copytree(run, workdir)
    for name in os.listdir(workdir):
        if name.startswith(("result-", "writes-")):
            os.remove(workdir / name)
    _drop_backups_after(workdir, 9)
    one_process(workdir)
    resumed = results(workdir)
    assert_same(resumed, results(run), TOLERANCE)


def _drop_backups_after(workdir, step):
    backup = os.path.join(workdir, "backup")
    for name in os.listdir(backup):
        number = {"jax": name, "torch": name[4:]}.get(BACKEND, name[5:].split(".")[0])
        if number.isdigit() and int(number) > step:
            path = os.path.join(backup, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def test_a_stopped_process_is_named_stops_the_launch_and_the_rerun_resumes(run, tmp_path):
    """Process 1 stops answering at step 10 (SIGSTOP: a stuck host, a frozen file system)
    while process 0 waits for it in a collective: the launcher names process 1, not the
    healthy one, past `--stall-timeout`, and ends the launch; the rerun resumes from the
    last backup. (A process that dies, SIGKILL, takes the same way from there: named by its
    exit, tests/cli/test_launch.py with plain processes, and on JAX's processes
    `test_a_killed_run_resumes_from_an_s3_backup`.)"""
    start = time.monotonic()
    failed = launch(tmp_path, "--stop", "1:10", check=False, launcher=("--stall-timeout", "5"))
    elapsed = time.monotonic() - start
    assert failed.returncode != 0
    assert "process 1 (pid " in failed.stderr, failed.stderr
    assert "stopped answering: it has been stopped (state T: SIGSTOP" in failed.stderr
    assert "process 0 (pid" not in failed.stderr, failed.stderr  # Not named as the cause.
    # Start-up (~10-20 s), training to step 10, then at most the grace for the survivor:
    # stopped by the launcher, not by TIMEOUT_S. The margin is for a loaded machine (the
    # suite runs both backends side by side).
    assert elapsed < 200, elapsed
    assert backup_steps(tmp_path)  # Something to resume from (steps 3, 6 or 9).
    launch(tmp_path)
    assert_same(results(tmp_path), results(run))


@pytest.mark.skipif(BACKEND != "jax", reason="the per-process staging of Orbax's shards")
def test_a_killed_run_resumes_from_an_s3_backup(run, tmp_path, s3_bucket):
    """Orbax cannot write s3://: each process stages its own shards locally and uploads
    them, the chief commits the step once every process has (keras_accel.state.staged).
    Under fsdp (each process holds half of every kernel), killed at step 10 and rerun, the
    run resumes from the bucket on both processes and ends with the weights of the
    uninterrupted run (data parallel, backed up to a local directory: the same bits here,
    measured) bit for bit."""
    import s3fs

    backup = f"{s3_bucket}/backup"
    # fsdp: the Dense kernels split over both processes' devices, so each process
    # writes shards of its own.
    fsdp = ("--backup", backup, "--strategy", "fsdp")
    failed = launch(tmp_path, "--die", "1:10", *fsdp, check=False)
    assert "killed by SIGKILL" in failed.stderr, failed.stderr[-3000:]
    fs = s3fs.S3FileSystem()
    committed = sorted(
        int(p.rsplit("-", 1)[1]) for p in fs.ls(backup) if fs.exists(f"{p}/COMMITTED")
    )
    assert committed, fs.ls(backup)  # Steps 3, 6 or 9: saved every 3 steps.
    # Process 1's shards and the chief's files, under one step.
    step = f"{backup}/orbax-{committed[-1]}"
    assert fs.exists(f"{step}/{committed[-1]}/state/_METADATA")
    mine = fs.find(f"{step}/process-1/{committed[-1]}/state")
    assert [p for p in mine if p.rsplit("/", 1)[1][0].isdigit()], mine  # Shards: "<chunk>".
    rerun = launch(tmp_path, *fsdp)
    for me in range(PROCESSES):  # From the bucket, not from the start (the same weights).
        assert f"[{me}] BackupAndRestore: restored {step}" in rerun.stdout, rerun.stdout[-3000:]
    assert_same(results(tmp_path), results(run))
    assert_same(results(tmp_path, 1), results(run))


def test_sigterm_saves_a_backup_then_the_rerun_resumes(run, tmp_path):
    """A preemption: SIGTERM to the launcher reaches every process, which agree on one step,
    save there, and exit with 143; the next launch resumes from that backup."""
    process = subprocess.Popen(
        _launch_command(tmp_path, "--stall-at", "10"),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        markers = [tmp_path / f"at-10-{i}" for i in range(PROCESSES)]
        while not all(m.exists() for m in markers):
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the run never reached step 10"
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, out[-3000:] + err[-3000:]
    assert "SIGTERM (preemption) reached every process" in out, out[-3000:]
    # Stopped early (no results), with a backup of where it stopped: after the SIGTERM at
    # step 10 or later, past the last regular one before it (9).
    assert not (tmp_path / "result-0.npz").exists()
    assert backup_steps(tmp_path)[-1] >= 11, backup_steps(tmp_path)
    launch(tmp_path)
    assert_same(results(tmp_path), results(run))


def test_custom_loop_processes_agree_and_match_one_process(tmp_path):
    """`Accelerator.loop` across processes: each feeds its rows (JAX) or reads its share of
    the distributed data set (TF), and predictions come back whole on every process."""
    launch(tmp_path / "two", "--loop", "custom")
    one_process(tmp_path / "one", "--loop", "custom")
    first, second = results(tmp_path / "two", 0), results(tmp_path / "two", 1)
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    reference = results(tmp_path / "one")
    assert first["predictions"].shape == (100, 3)
    assert_same(first, reference, TOLERANCE)
    for key in ("loss", "evaluation", "predictions"):
        np.testing.assert_allclose(first[key], reference[key], atol=10 * TOLERANCE, err_msg=key)


def _write_records(path, rows, file, seed):
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    with tf.io.TFRecordWriter(str(path)) as writer:
        for features, target in zip(x, y, strict=True):
            feature = {
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=features)),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[target])),
                "file": tf.train.Feature(int64_list=tf.train.Int64List(value=[file])),
            }
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())


@pytest.mark.skipif(
    BACKEND == "torch", reason="on torch each process reads the files whole (docs/multi_host.md)"
)
def test_each_process_reads_only_its_files(tmp_path):
    """A file-backed tf.data pipeline over two processes: each reads only its own file
    (sharded by file, not read whole and cut), and the numbers equal one process's: the
    same rows in every global batch for training; evaluation files that end after 4 and 2
    batches in the two processes (the one that ran out feeds padding until both have
    ended), counted exactly; every prediction once."""
    data = tmp_path / "data"
    data.mkdir()
    for file, (train_rows, eval_rows) in enumerate([(28, 28), (28, 13)]):
        _write_records(data / f"train-{file}.tfrecord", train_rows, file, seed=file)
        _write_records(data / f"eval-{file}.tfrecord", eval_rows, file, seed=10 + file)
    one, two = tmp_path / "one", tmp_path / "two"
    for workdir in (one, two):
        shutil.copytree(data, workdir)
    launch(two, script=FILES_SCRIPT)
    one_process(one, script=FILES_SCRIPT)

    def load(workdir, process):
        with np.load(os.path.join(workdir, f"files-{process}.npz")) as f:
            return dict(f)

    first, second, reference = load(two, 0), load(two, 1), load(one, 0)
    for process, result in enumerate((first, second)):
        counts = json.loads(str(result["counts"]))
        assert set(counts["train"]) == {str(process)}, counts
        assert set(counts["eval"]) == {str(process)}, counts
        assert counts["eval"][str(process)] >= (28, 13)[process], counts
        assert set(counts["loop"]) == {str(process)}, counts  # acc.loop too.
    assert set(json.loads(str(reference["counts"]))["train"]) == {"0", "1"}
    for key in first:
        if key not in ("counts", "grain_read"):  # What each process read is its own.
            np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    assert_same(first, reference, TOLERANCE)
    loop_weights = [k for k in sorted(first, key=lambda k: (len(k), k)) if k.startswith("loop_w")]
    assert loop_weights
    for key in loop_weights:
        np.testing.assert_allclose(first[key], reference[key], atol=TOLERANCE, err_msg=key)
    for key in ("loss", "evaluation", "loop_train", "loop_eval"):
        np.testing.assert_allclose(first[key], reference[key], atol=10 * TOLERANCE, err_msg=key)
    # The two processes' rows come step by step (process 0's share of each global batch
    # before process 1's), one process's as the interleave reads them: the same rows.
    assert first["predictions"].shape == reference["predictions"].shape == (41, 3)
    order = lambda p: p[np.lexsort(p.T[::-1])]  # noqa: E731
    np.testing.assert_allclose(
        order(first["predictions"]), order(reference["predictions"]), atol=10 * TOLERANCE
    )
    if BACKEND == "jax":
        _assert_grain_rows_shared(first, second, reference)


def _assert_grain_rows_shared(first, second, reference):
    """A batched Grain MapDataset over two processes: each read only its block of every
    batch of 16 (rows 0-7 or 8-15 of it; the last evaluation batch's 4 rows are process
    0's), and training (fit and acc.loop), evaluation and predictions (in order) equal one
    process's."""
    for process, result in enumerate((first, second)):
        read = json.loads(str(result["grain_read"]))
        for kind, rows in (("train", 44), ("eval", 36)):
            mine = {i for i in range(rows) if (i % 16) // 8 == process}
            assert set(read[kind]) == mine, (process, kind, sorted(read[kind]))
    assert set(json.loads(str(reference["grain_read"]))["train"]) == set(range(44))
    keys = sorted(k for k in first if k.startswith(("grain_w", "grain_loop_w")))
    assert len(keys) == 2 * len([k for k in first if k.startswith("grain_w")]) > 0
    for key in keys:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
        np.testing.assert_allclose(first[key], reference[key], atol=TOLERANCE, err_msg=key)
    for key in ("grain_loss", "grain_evaluation"):
        np.testing.assert_allclose(first[key], reference[key], atol=10 * TOLERANCE, err_msg=key)
    assert first["grain_predictions"].shape == (36, 3)
    np.testing.assert_allclose(
        first["grain_predictions"], reference["grain_predictions"], atol=10 * TOLERANCE
    )


@pytest.mark.skipif(BACKEND != "jax", reason="model_parallel meshes are JAX's")
def test_model_parallel_mesh_across_processes(tmp_path):
    """A 1 x 8 mesh over 2 processes: the model axis spans them (each holds half of every
    kernel) and the batch is not split (each feeds every row); equal to one process."""
    script = os.path.join(os.path.dirname(__file__), "_model_parallel.py")
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    command += ["--devices-per-process", "4", "--grace", str(GRACE_S), script, str(tmp_path)]
    result = subprocess.run(
        [*command, "1,8"], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = results(tmp_path, 0), results(tmp_path, 1)
    # The kernel's output axis is sharded, read after the checkpoints were written.
    assert "'model'" in str(first["spec"])
    assert_checkpoints_hold(tmp_path, first)

    from keras_accel import Accelerator
    from tests.distributed import _model_parallel

    model, losses, predictions = _model_parallel.build_and_train(
        Accelerator(strategy="model_parallel", mesh_shape=(1, 8), seed=0)
    )
    for key in first:
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    # Keras's thread pool for batch-end callbacks is off across processes (it deadlocked
    # their collectives), by a callback of the call's, not by Keras's module switch; one
    # process keeps the pool.
    assert len(first["threads_in_fit"]) == 14 and all(first["threads_in_fit"])
    assert bool(first["thread_safe"])
    assert len(_model_parallel.BUILT["threads_in_fit"]) == 14
    assert not any(_model_parallel.BUILT["threads_in_fit"])
    np.testing.assert_allclose(first["loss"], losses, atol=TOLERANCE)
    np.testing.assert_allclose(first["predictions"], predictions, atol=10 * TOLERANCE)
    for i, variable in enumerate(model.weights):
        np.testing.assert_allclose(first[f"w{i}"], np.asarray(variable.value), atol=TOLERANCE)


def assert_checkpoints_hold(workdir, first):
    """The chief's ModelCheckpoint files (tests/distributed/_model_parallel.py) hold the
    trained state whole: the weights load into a model on one device and equal the gathered
    arrays, the .keras file's optimizer too; nothing else is left in the directory."""
    import keras

    names = sorted(os.listdir(workdir))
    assert names == ["model.keras", "result-0.npz", "result-1.npz", "weights.weights.h5"], names
    twin = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(8)]
    )
    twin.load_weights(os.path.join(workdir, "weights.weights.h5"))
    for i, weight in enumerate(twin.get_weights()):
        np.testing.assert_array_equal(weight, first[f"w{i}"], err_msg=f"w{i}")
    loaded = keras.saving.load_model(os.path.join(workdir, "model.keras"))
    for i, weight in enumerate(loaded.get_weights()):
        np.testing.assert_array_equal(weight, first[f"w{i}"], err_msg=f"w{i} (.keras)")
    # SGD with momentum: 2 epochs of 7 steps, and a momentum per weight, saved whole.
    assert int(loaded.optimizer.iterations) == 14
    momenta = [v for v in loaded.optimizer.variables if v.shape == (6, 16)]
    assert len(momenta) == 1 and np.any(np.asarray(momenta[0]) != 0)


@pytest.mark.skipif(BACKEND != "jax", reason="fsdp is JAX's")
def test_fsdp_across_processes(tmp_path):
    """strategy="fsdp" on 2 processes x 4 devices: every variable split over a data axis that
    spans both (each process holds half of every kernel, on its 4 devices), each process
    feeding its rows of every batch; equal to one process of 8."""
    script = os.path.join(os.path.dirname(__file__), "_model_parallel.py")
    command = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    command += ["--devices-per-process", "4", "--grace", str(GRACE_S), script, str(tmp_path)]
    result = subprocess.run(
        [*command, "8,1", "fsdp"], env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = results(tmp_path, 0), results(tmp_path, 1)
    assert str(first["spec"]) == "P(None, 'batch')"  # (6, 16): the 16 split.
    # Every weight has a dimension 8 divides, so each is split in 8: 4 shards per process.
    assert list(first["shards"]) == [4, 4, 4, 4]
    assert_checkpoints_hold(tmp_path, first)  # Saved whole; the arrays above still split.

    from keras_accel import Accelerator
    from tests.distributed import _model_parallel

    model, losses, predictions = _model_parallel.build_and_train(
        Accelerator(strategy="fsdp", seed=0)
    )
    for key in ("loss", "predictions", *(f"w{i}" for i in range(len(model.weights)))):
        np.testing.assert_array_equal(first[key], second[key], err_msg=key)
    np.testing.assert_allclose(first["loss"], losses, atol=TOLERANCE)
    np.testing.assert_allclose(first["predictions"], predictions, atol=10 * TOLERANCE)
    for i, variable in enumerate(model.weights):
        np.testing.assert_allclose(first[f"w{i}"], np.asarray(variable.value), atol=TOLERANCE)
