"""The seed models: the CIFAR-10 MLP and CNN of the TPU-vs-GPU post, a tiny BERT classifier.

`mlp` and `cnn` rebuild, layer for layer, the two models the benchmark seed measured;
`compile_seed` applies that seed's optimizer, loss and metric; `training_flops` counts the
work of one training step analytically (for MFU); `bert_classifier` builds a keras-hub BERT
text classifier from a local vocabulary or a local preset directory, never downloading.
"""

from keras_accel.models.bert import bert_classifier
from keras_accel.models.flops import forward_flops, training_flops
from keras_accel.models.seed import cnn, compile_seed, mlp, seed_compile_kwargs

__all__ = [
    "bert_classifier",
    "cnn",
    "compile_seed",
    "forward_flops",
    "mlp",
    "seed_compile_kwargs",
    "training_flops",
]
