"""Ray Train's driver for test_ray.py: a local Ray cluster, then `_ray_train.train` twice under
one trainer, uninterrupted into WORKDIR/straight and with a worker killed mid-epoch into
WORKDIR/killed (`FailureConfig(max_failures=1)`: Ray restarts the worker group once). Usage:

    python tests/distributed/_ray_driver.py TRAINER WORKDIR

TRAINER: `torch` (TorchTrainer, 2 workers: Ray makes the gloo process group), `tensorflow`
(TensorflowTrainer, 2 workers: Ray sets TF_CONFIG), `jax` (JaxTrainer, 1 worker: on CPUs
Ray joins no JAX cluster, so each worker is a run of its own). Prints one JSON line last:
each run's error (None when it ended well) and the attempts Ray made.
"""

import json
import os
import sys

import ray
from ray.train import FailureConfig, RunConfig, ScalingConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.distributed._ray_train import train  # noqa: E402

# Which worker dies, and where: the end of batch 2 of epoch 1 (step 9 of 18; the last
# backup before it is step 8), the second worker where there are two.
KILL = {"torch": "1:1:2", "tensorflow": "1:1:2", "jax": "0:1:2"}
WORKERS = {"torch": 2, "tensorflow": 2, "jax": 1}


ENV = {
    "PYTHONPATH": ROOT,  # The workers import keras_accel and this folder's modules.
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "OMP_NUM_THREADS": "1",  # As keras-accel launch sets for several torch processes.
}


def trainer(kind: str, workdir: str, kill: str | None):
    config = {"workdir": workdir, **({"kill": kill} if kill else {})}
    run = RunConfig(
        name="run",
        storage_path=os.path.join(workdir, "ray"),
        failure_config=FailureConfig(max_failures=1),
        # Each worker's backend: a Ray worker process takes Keras's from its environment.
        worker_runtime_env={"env_vars": {**ENV, "KERAS_BACKEND": kind}},
    )
    scaling = ScalingConfig(num_workers=WORKERS[kind])
    if kind == "torch":
        from ray.train.torch import TorchTrainer

        return TorchTrainer(train, train_loop_config=config, scaling_config=scaling, run_config=run)
    if kind == "tensorflow":
        from ray.train.tensorflow import TensorflowTrainer

        return TensorflowTrainer(
            train, train_loop_config=config, scaling_config=scaling, run_config=run
        )
    from ray.train.v2.jax import JaxTrainer

    return JaxTrainer(train, train_loop_config=config, scaling_config=scaling, run_config=run)


def main(kind: str, workdir: str) -> None:
    ray.init(num_cpus=4, include_dashboard=False, runtime_env={"env_vars": ENV})
    report = {}
    try:
        for name, kill in (("straight", None), ("killed", KILL[kind])):
            directory = os.path.join(workdir, name)
            os.makedirs(directory, exist_ok=True)
            result = trainer(kind, directory, kill).fit()
            report[name] = None if result.error is None else repr(result.error)
    finally:
        ray.shutdown()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
