"""A plain Keras call on a model built in the Accelerator's scope: on TensorFlow that is raw
`MirroredStrategy` training, which turns the weights NaN when a batch leaves a replica
without rows (BatchNormalization over no rows). A warning says so before the first step,
where the batches may not split over the replicas; the Accelerator's own calls, and
`acc.dataset`'s even batches under a plain `model.fit`, get none."""

import warnings

import pytest

from keras_accel import Accelerator
from tests.conftest import BACKEND
from tests.helpers import FEW_REPLICAS, compiled_mlp, data

pytestmark = pytest.mark.skipif(
    BACKEND != "tensorflow" or FEW_REPLICAS < 2,
    reason="TensorFlow's MirroredStrategy over several replicas (JAX pads on its own)",
)


def test_plain_fit_of_uneven_batches_is_warned_and_the_accelerator_is_not():
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(9)  # Batches of 4, 4 and 1: the last leaves a replica without rows.
    with pytest.warns(UserWarning, match=r"raw tf.distribute.MirroredStrategy over 2 replicas"):
        model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        acc.fit(model, x, y, batch_size=4, epochs=1, verbose=0)
        model.fit(acc.dataset(x, y, batch_size=4), epochs=1, verbose=0, shuffle=False)
