"""KERAS_BACKEND=torch: the scope places nothing there (each process holds a whole copy, on the
device Keras gives it), so a model built outside `acc.scope()` is the same model and trains
as one built inside it, over 2 processes (`keras-accel launch -n 2`) as in one (README,
"one API"; `Accelerator.prepare`)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.conftest import BACKEND

pytestmark = [
    pytest.mark.torch,
    pytest.mark.skipif(BACKEND != "torch", reason="the torch backend's processes"),
]

SCRIPT = textwrap.dedent(
    """
    import sys

    import keras
    import numpy as np

    from keras_accel import Accelerator

    acc = Accelerator(seed=0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(45, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")


    def build():
        model = keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            keras.optimizers.SGD(0.1),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return model


    outside = build()
    with acc.scope():
        inside = build()
    inside.set_weights(outside.get_weights())
    start = outside.get_weights()
    for model in (outside, inside):
        acc.fit(model, x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    arrays = {f"outside{i}": w for i, w in enumerate(outside.get_weights())}
    arrays.update({f"inside{i}": w for i, w in enumerate(inside.get_weights())})
    arrays.update({f"start{i}": w for i, w in enumerate(start)})
    arrays["replicas"] = np.array(acc.num_replicas)
    np.savez(f"{sys.argv[1]}-{acc.process_index}.npz", **arrays)
    """
)


def _run(command):
    env = dict(os.environ, PYTHONUNBUFFERED="1", KERAS_BACKEND="torch")
    env.pop("KERAS_ACCEL_TEST_DEVICES", None)
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL
    )


def test_a_model_built_outside_the_scope_trains_as_one_built_inside_over_two_processes(
    tmp_path,
):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch = [sys.executable, "-m", "keras_accel.cli.main", "launch", "-n", "2"]
    result = _run([*launch, str(script), str(tmp_path / "two")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = (dict(np.load(tmp_path / f"two-{rank}.npz")) for rank in (0, 1))
    assert int(first["replicas"]) == 2
    names = [k for k in first if k.startswith("outside")]
    assert names
    for name in names:
        inside = name.replace("outside", "inside")
        np.testing.assert_array_equal(first[name], second[name], err_msg=name)
        np.testing.assert_allclose(first[name], first[inside], rtol=0, atol=1e-6, err_msg=name)
    moved = max(np.abs(first[n] - first[n.replace("outside", "start")]).max() for n in names)
    assert moved > 1e-3  # It trained: a model left as it was would match too.
