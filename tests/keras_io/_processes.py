"""One process of a run of keras-io's ports over processes (torch, JAX): each process runs the
examples named on the command line through `Accelerator.fit`, `evaluate` and `predict`, and
their plain Keras twins on the whole data itself, from the same initial variables, as
tests/keras_io/test_keras_io.py does in one process.
Usage: python _processes.py OUT NAME...; every process writes OUT-<process>.npz, keys
"<name>/<what>/ours" and "<name>/<what>/one"."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import functools  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_accel import Accelerator  # noqa: E402
from tests.helpers import keep_pair  # noqa: E402
from tests.keras_io import keras_recipes, vision  # noqa: E402, F401  (registers the ports)
from tests.keras_io._port import EXAMPLES  # noqa: E402
from tests.keras_io.test_keras_io import BUILD_SEED, FIT_SEED  # noqa: E402

acc = Accelerator(seed=0)
out = {}

keep = functools.partial(keep_pair, out)


for name in sys.argv[2:]:
    example = EXAMPLES[name]
    with acc.scope():
        keras.utils.set_random_seed(BUILD_SEED)
        port = example.port()
    keras.utils.set_random_seed(BUILD_SEED)
    twin = example.port()
    twin.model.set_weights(port.model.get_weights())
    keras.utils.set_random_seed(FIT_SEED)
    want = twin.model.fit(**twin.fit, shuffle=False, verbose=0).history
    keras.utils.set_random_seed(FIT_SEED)
    got = acc.fit(port.model, **port.fit, shuffle=False, verbose=0).history
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for key in want:
        keep(name, f"history.{key}", got[key], want[key])
    keep(name, "weights", port.model.get_weights(), twin.model.get_weights())
    if port.evaluate is not None:
        want = twin.model.evaluate(**twin.evaluate, verbose=0, return_dict=True)
        got = acc.evaluate(port.model, **port.evaluate, verbose=0, return_dict=True)
        assert sorted(got) == sorted(want), (sorted(got), sorted(want))
        for key in want:
            keep(name, f"evaluate.{key}", got[key], want[key])
    if port.predict is not None:
        want = twin.model.predict(**twin.predict, verbose=0)
        keep(name, "predict", acc.predict(port.model, **port.predict, verbose=0), want)
np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **out)
