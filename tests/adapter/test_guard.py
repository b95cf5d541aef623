"""The recompile guard: every trace after warm-up reported with its cause, each trace once."""

import warnings

import keras
import numpy as np

from keras_accel import Accelerator
from keras_accel.callbacks._run import run_state
from tests.helpers import FEW_REPLICAS, compiled_mlp, data


def _traces(acc, kind):
    return [trace for trace in acc.guard.traces if trace.kind == kind]


class _EveryFourth(keras.callbacks.Callback):
    """Test batch hooks that take groups of 4 steps (keras_accel's `_fusion_period`)."""

    def __init__(self):
        super().__init__()
        self.ends = []

    def _fusion_period(self, kind, steps):
        return 4

    def on_test_batch_end(self, batch, logs=None):
        self.ends.append(batch)


def test_one_fused_step_function_serves_every_n():
    # fit fuses its 13 steps, and validates with that N; an evaluate fusing 5 (or 4) steps
    # per call runs the same compiled test step (N is read at each call), N steps a call.
    acc = Accelerator(seed=0, devices=FEW_REPLICAS)
    with acc.scope():
        model = compiled_mlp()
    x, y = data(101)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        acc.fit(model, x, y, batch_size=8, verbose=0, validation_data=(x, y))
        assert run_state(model).steps_per_execution == 13
        short = acc.evaluate(model, x[:37], y[:37], batch_size=8, verbose=0)
        fours = _EveryFourth()
        grouped = acc.evaluate(model, x, y, batch_size=8, verbose=0, callbacks=[fours])
    assert fours.ends == [3, 7, 11, 15]  # Keras's last group, of 1 step, ends at "15".
    assert len(_traces(acc, "test")) == 1 and acc.num_recompiles == 0
    plain = compiled_mlp()
    plain.set_weights(model.get_weights())
    want = plain.evaluate(x, y, batch_size=101, verbose=0)
    np.testing.assert_allclose(grouped, want, rtol=1e-5)
    want = plain.evaluate(x[:37], y[:37], batch_size=37, verbose=0)
    np.testing.assert_allclose(short, want, rtol=1e-5)
