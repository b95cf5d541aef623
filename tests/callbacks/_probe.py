"""A model whose weights reveal the learning rate each optimizer step really used.

One weight `w`, inputs of 1 and the loss `mean(y_pred) = w`: its gradient is exactly 1 at
every step, on every replica and with any padding (padding rows carry weight 0), so plain
SGD (no momentum) moves `w` by exactly `-lr`. Reading `w` after every batch recovers the
rates the compiled step used, independent of any callback's bookkeeping.
"""

import keras
import numpy as np


def probe_model(optimizer=None):
    model = keras.Sequential(
        [keras.Input((1,)), keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")]
    )
    model.compile(optimizer or keras.optimizers.SGD(0.1), loss=prediction_loss)
    return model


def prediction_loss(y_true, y_pred):
    return y_pred[:, 0]


def probe_data(rows):
    return np.ones((rows, 1), "float32"), np.zeros((rows, 1), "float32")


class UsedRates(keras.callbacks.Callback):
    """Records `(optimizer step, rate used)` for every training step."""

    def on_train_begin(self, logs=None):
        self.rates, self.steps = [], []
        self._weight = self._read()

    def _read(self):
        # `self.model` pulls the JAX training state back onto the variables first.
        return float(np.asarray(self.model.layers[0].kernel.numpy()).ravel()[0])

    def on_train_batch_end(self, batch, logs=None):
        weight = self._read()
        self.rates.append(self._weight - weight)
        self._weight = weight
        self.steps.append(int(np.asarray(self.model.optimizer.iterations.numpy())) - 1)
