"""keras-io's ports whose code weights no rows (a `compute_loss` of the model's own, a
layer's `add_loss`, a loss of one value per batch) through `acc.fit`, `evaluate` and
`predict` over two processes (`keras-accel launch -n 2`), against plain Keras in one process
(tests/keras_io/_processes.py): on torch their last partial batches run whole in every
process; on JAX, one device per process, the global batch is cut to its real rows in the
program ("cut"), each process feeding its share of it. Nothing is dropped or refused and every
number is plain Keras's. Over one process's devices: test_keras_io.py."""

import os

import pytest

from tests.adapter.test_torch_replicated import compare, launch
from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND == "tensorflow", reason="one worker's replicas: test_keras_io.py"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_processes.py")
NAMES = [
    "vision/knowledge_distillation",
    "keras_recipes/endpoint_layer_pattern",
    "vision/siamese_contrastive",
]


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    out = tmp_path_factory.mktemp("keras-io-processes") / "two"
    return launch(SCRIPT, out, *NAMES, backend=BACKEND)


@pytest.mark.parametrize("name", NAMES)
def test_keras_io_example_over_two_processes_as_plain_keras(processes, name):
    saved, output = processes
    for process in saved:
        keys = compare(process, f"{name}/")
        assert any("/weights." in key for key in keys)
    assert "is dropped" not in output
