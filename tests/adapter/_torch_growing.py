"""One process of a torch run (or the one-process reference) on batches that grow: a
generator, a PyDataset and tf.data whose batches of 3, 8 and 5 rows are larger than the
first, so each process takes its contiguous share of a bucket (the static size doubled until
the batch fits). Usage: python _torch_growing.py OUT; writes OUT-<process>.npz."""

import sys

import keras
import numpy as np

from keras_accel import Accelerator

SIZES = (3, 8, 5, 8, 1)  # 25 rows: buckets of 4 (the first, over 2 processes), 8.
ROWS = sum(SIZES)
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 4)).astype("float32")
Y = rng.normal(size=(ROWS, 2)).astype("float32")
STOPS = np.cumsum(SIZES)
BOUNDS = list(zip(STOPS - np.asarray(SIZES), STOPS))


def generator(targets=True):
    for start, stop in BOUNDS:
        yield (X[start:stop], Y[start:stop]) if targets else (X[start:stop],)


class Growing(keras.utils.PyDataset):
    def __len__(self):
        return len(SIZES)

    def __getitem__(self, index):
        start, stop = BOUNDS[index]
        return X[start:stop], Y[start:stop]


def tfdata(targets=True):
    import tensorflow as tf

    spec = tf.TensorSpec((None, 4), tf.float32)
    signature = (spec, tf.TensorSpec((None, 2), tf.float32)) if targets else (spec,)
    return tf.data.Dataset.from_generator(lambda: generator(targets), output_signature=signature)


SOURCES = {
    "generator": generator,
    "pydataset": lambda targets=True: Growing() if targets else generator(False),
    "tfdata": tfdata,
}


def main(out):
    acc = Accelerator()
    results = {}
    for name, make in SOURCES.items():
        keras.utils.set_random_seed(1)
        with acc.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            model.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
        history = acc.fit(model, make(), epochs=1, shuffle=False, verbose=0)
        results[f"{name}/loss"] = np.asarray(history.history["loss"])
        for i, weight in enumerate(model.get_weights()):
            results[f"{name}/w{i}"] = weight
        logs = acc.evaluate(model, make(), verbose=0, return_dict=True)
        results[f"{name}/evaluate"] = np.asarray([logs["loss"], logs["mae"]])
        results[f"{name}/predict"] = acc.predict(model, make(False), verbose=0)
        if acc.num_processes == 1:  # The reference: plain one-device Keras, same batches.
            keras.utils.set_random_seed(1)
            twin = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
            twin.compile(keras.optimizers.SGD(0.1), "mse", metrics=["mae"])
            history = twin.fit(make(), epochs=1, shuffle=False, verbose=0)
            results[f"keras/{name}/loss"] = np.asarray(history.history["loss"])
            for i, weight in enumerate(twin.get_weights()):
                results[f"keras/{name}/w{i}"] = weight
            logs = twin.evaluate(make(), verbose=0, return_dict=True)
            results[f"keras/{name}/evaluate"] = np.asarray([logs["loss"], logs["mae"]])
            results[f"keras/{name}/predict"] = twin.predict(make(False), verbose=0)
    np.savez(f"{out}-{acc.process_index}.npz", **results)


if __name__ == "__main__":
    main(sys.argv[1])
