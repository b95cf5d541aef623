"""keras-io's ports whose code weights no rows (a `compute_loss` of the model's own, a
layer's `add_loss`, a loss of one value per batch) through `acc.fit`, `evaluate` and
`predict` over two torch processes (`keras-accel launch -n 2`), against plain Keras in one
process (tests/keras_io/_torch_processes.py): their last partial batches run whole in every
process, so nothing is dropped or refused and every number is plain Keras's. JAX and
TensorFlow run the ports over their devices in test_keras_io.py."""

import os

import pytest

from tests.adapter.test_torch_replicated import compare, launch
from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = os.path.join(os.path.dirname(__file__), "_torch_processes.py")
NAMES = [
    "vision/knowledge_distillation",
    "keras_recipes/endpoint_layer_pattern",
    "vision/siamese_contrastive",
]


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    return launch(SCRIPT, tmp_path_factory.mktemp("keras-io-processes") / "two", *NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_keras_io_example_over_two_torch_processes_as_plain_keras(processes, name):
    saved, output = processes
    for process in saved:
        keys = compare(process, f"{name}/")
        assert any("/weights." in key for key in keys)
    assert "is dropped" not in output
