"""The classifier that the multi-process scripts (`_train.py`, `_files.py`) train: 6 features,
3 classes, a BatchNormalization layer (whose statistics must span every process's rows), SGD
with momentum. Imported by those scripts from their own folder (they run as scripts)."""

import keras


def compiled_classifier(acc):
    """The classifier, built and compiled in `acc`'s scope."""
    with acc.scope():
        model = keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(16, activation="relu"),
                keras.layers.BatchNormalization(),
                keras.layers.Dense(3),
            ]
        )
        model.compile(
            keras.optimizers.SGD(0.05, momentum=0.9),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model
