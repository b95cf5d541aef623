"""Learning-rate schedules: serializable Keras schedules built on pure `step -> value` functions.

Every class is a `keras.optimizers.schedules.LearningRateSchedule`, so it can be passed as an
optimizer's `learning_rate` and saved with the model; the math lives in
`keras_accel.schedules.functional`. Schedules relative to the length of training take
`total_steps` at construction or through `with_total_steps()` (see `Schedule`).

Example:

>>> import keras
>>> from keras_accel.schedules import WarmupCosine
>>> optimizer = keras.optimizers.Adam(
...     learning_rate=WarmupCosine(1e-3, warmup_fraction=0.05, total_steps=1000))
"""

from keras_accel.schedules import functional
from keras_accel.schedules.base import Schedule
from keras_accel.schedules.decay import CosineDecay, ExponentialDecay, LinearDecay
from keras_accel.schedules.join import Join
from keras_accel.schedules.piecewise import Constant, PiecewiseConstant
from keras_accel.schedules.validation import evaluate_learning_rate, validate_learning_rate
from keras_accel.schedules.warmup import Warmup, WarmupCosine, WarmupLinear

__all__ = [
    "Constant",
    "CosineDecay",
    "ExponentialDecay",
    "Join",
    "LinearDecay",
    "PiecewiseConstant",
    "Schedule",
    "Warmup",
    "WarmupCosine",
    "WarmupLinear",
    "evaluate_learning_rate",
    "functional",
    "validate_learning_rate",
]
