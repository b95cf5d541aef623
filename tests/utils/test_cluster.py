"""What the environment says about a multi-process run (`keras_accel.utils.cluster`)."""

import json

import pytest

from keras_accel.utils import cluster
from keras_accel.utils.cluster import Cluster, detect

# Backend-generic: the torch run takes these too (tests/conftest.py).
pytestmark = pytest.mark.torch

ALL = (
    *cluster.KERAS_VARIABLES,
    cluster.SWITCH,
    "TF_CONFIG",
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "TPU_WORKER_HOSTNAMES",
    "TPU_WORKER_ID",
    "MEGASCALE_COORDINATOR_ADDRESS",
)


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _keras(monkeypatch, addresses="127.0.0.1:1234", count="2", index="1"):
    monkeypatch.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", addresses)
    monkeypatch.setenv("KERAS_DISTRIBUTION_NUM_PROCESSES", count)
    monkeypatch.setenv("KERAS_DISTRIBUTION_PROCESS_ID", index)


@pytest.mark.parametrize("backend", ["jax", "tensorflow", "torch"])
def test_nothing_set_is_one_process(backend):
    assert detect(backend) is None


def test_keras_variables_describe_a_jax_cluster(clean):
    _keras(clean)
    assert detect("jax") == Cluster("KERAS_DISTRIBUTION_* variables", 2, 1, "127.0.0.1:1234")
    assert detect("tensorflow") is None  # TF reads TF_CONFIG only.


def test_all_addresses_listed_count_the_processes(clean):
    clean.setenv("KERAS_DISTRIBUTION_JOB_ADDRESSES", "10.0.0.1:1,10.0.0.2:1,10.0.0.3:1")
    clean.setenv("KERAS_DISTRIBUTION_PROCESS_ID", "2")
    found = detect("jax")
    assert (found.num_processes, found.process_id, found.coordinator) == (3, 2, "10.0.0.1:1")


def test_one_process_described_is_one_process(clean):
    _keras(clean, count="1", index="0")
    assert detect("jax") is None


@pytest.mark.parametrize(
    "values, message",
    [
        (("127.0.0.1:1", "2", "2"), r"KERAS_DISTRIBUTION_PROCESS_ID must be in \[0, 2\)"),
        (("127.0.0.1:1", "0", "0"), "at least 1"),
        (("a:1,b:1,c:1", "2", "0"), "lists 3 addresses but KERAS_DISTRIBUTION_NUM_PROCESSES=2"),
        (("127.0.0.1:1", "two", "0"), "must be an integer. Received: .*'two'"),
        (("", "2", "0"), "Missing: KERAS_DISTRIBUTION_JOB_ADDRESSES"),
        (("127.0.0.1:1", "2", ""), "Missing: KERAS_DISTRIBUTION_PROCESS_ID"),
    ],
)
def test_inconsistent_keras_variables_are_named(clean, values, message):
    _keras(clean, *values)
    with pytest.raises(ValueError, match=message):
        detect("jax")


def test_cluster_managers_jax_detects(clean):
    clean.setenv("SLURM_JOB_ID", "7")
    clean.setenv("SLURM_NTASKS", "4")
    clean.setenv("SLURM_PROCID", "3")
    assert detect("jax") == Cluster("SLURM", 4, 3)
    clean.delenv("SLURM_JOB_ID")
    clean.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert detect("jax").source == "Open MPI"
    clean.delenv("OMPI_COMM_WORLD_SIZE")
    clean.setenv("TPU_WORKER_HOSTNAMES", "t0,t1,t2,t3")
    clean.setenv("TPU_WORKER_ID", "1")
    assert detect("jax") == Cluster("Cloud TPU pod", 4, 1)


def test_a_single_task_of_a_manager_is_one_process(clean):
    clean.setenv("SLURM_JOB_ID", "7")
    clean.setenv("SLURM_NTASKS", "1")
    clean.setenv("TPU_WORKER_HOSTNAMES", "only-one")
    assert detect("jax") is None


def test_tf_config_describes_workers(clean):
    workers = ["127.0.0.1:1", "127.0.0.1:2"]
    config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": 1}}
    clean.setenv("TF_CONFIG", json.dumps(config))
    assert detect("tensorflow") == Cluster("TF_CONFIG", 2, 1, "127.0.0.1:1")
    assert detect("jax") is None
    config["cluster"] = {"chief": ["c:1"], "worker": workers}
    config["task"] = {"type": "worker", "index": 0}
    clean.setenv("TF_CONFIG", json.dumps(config))
    assert detect("tensorflow") == Cluster("TF_CONFIG", 3, 1, "c:1")  # After the chief.


def test_tf_config_of_one_worker_is_one_process(clean):
    config = {"cluster": {"worker": ["127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    clean.setenv("TF_CONFIG", json.dumps(config))
    assert detect("tensorflow") is None


def test_bad_tf_config_is_named(clean):
    clean.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON. Received"):
        detect("tensorflow")
    clean.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}))
    with pytest.raises(ValueError, match="no valid task for this process: task={}"):
        detect("tensorflow")


def test_the_switch_overrides_detection(clean):
    _keras(clean)
    clean.setenv(cluster.SWITCH, "0")
    assert detect("jax") is None
    clean.setenv(cluster.SWITCH, "maybe")
    with pytest.raises(ValueError, match="KERAS_ACCEL_DISTRIBUTED must be 0 .*='maybe'"):
        detect("jax")
    for name in cluster.KERAS_VARIABLES:
        clean.delenv(name)
    clean.setenv(cluster.SWITCH, "1")
    assert detect("jax") == Cluster("KERAS_ACCEL_DISTRIBUTED=1")  # JAX's detectors decide.
    with pytest.raises(ValueError, match="needs TF_CONFIG naming every worker"):
        detect("tensorflow")


def test_joining_after_jax_computed_says_what_to_do(clean, backend):
    if backend != "jax":
        pytest.skip(
            "the join-before-computing rule is JAX's; on TF the strategy would try to "
            "reach a real cluster from this process"
        )
    import jax.numpy as jnp

    from keras_accel import Accelerator

    jnp.ones(2).block_until_ready()  # This process has computed already.
    _keras(clean, index="0")
    with pytest.raises(RuntimeError, match="first thing in the script"):
        Accelerator()


def test_multi_worker_without_tf_config_is_refused(backend):
    from keras_accel import Accelerator

    if backend == "tensorflow":
        with pytest.raises(ValueError, match="needs TF_CONFIG naming every worker"):
            Accelerator(strategy="multi_worker")
    else:  # JAX: every process's devices, the same as data_parallel in one process.
        assert Accelerator(strategy="multi_worker").strategy_name == "data_parallel"


def test_an_uncaught_error_ends_a_cluster_process_at_once(tmp_path):
    """A thread stuck in a cross-process protocol (a checkpoint writer waiting for peers)
    would keep Python from exiting: in a cluster, the error ends the process anyway."""
    import subprocess
    import sys

    script = tmp_path / "stuck.py"
    script.write_text(
        "import threading\n"
        "from keras_accel.utils import cluster\n"
        "cluster.exit_on_uncaught_error()\n"
        "threading.Thread(target=threading.Event().wait).start()  # Never ends.\n"
        "raise ValueError('the error')\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "ValueError: the error" in result.stderr  # The traceback, as usual.


def test_the_exit_on_error_hook_is_opt_out(monkeypatch):
    import sys

    monkeypatch.setattr(cluster, "_exit_hook_installed", False)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # Given back after the test.
    before = sys.excepthook
    monkeypatch.setenv("KERAS_ACCEL_EXIT_ON_ERROR", "0")
    cluster.exit_on_uncaught_error()
    assert sys.excepthook is before
    monkeypatch.setenv("KERAS_ACCEL_EXIT_ON_ERROR", "yes")
    with pytest.raises(ValueError, match="KERAS_ACCEL_EXIT_ON_ERROR must be 1 .* or 0 .*'yes'"):
        cluster.exit_on_uncaught_error()
    monkeypatch.setenv("KERAS_ACCEL_EXIT_ON_ERROR", "1")
    cluster.exit_on_uncaught_error()
    assert sys.excepthook is not before
