"""One process of a multi-process run over TFRecord files, started by `keras-accel launch` (or
alone, as the one-process reference). Usage:

    python _files.py WORKDIR [--devices N]

WORKDIR holds `train-0.tfrecord`, `train-1.tfrecord` (28 rows each) and `eval-0.tfrecord`,
`eval-1.tfrecord` (28 and 13 rows), written by the test: records of `x` (6 floats), `y` (an
int) and `file` (the file's index). Every process runs the same pipeline,
`from_tensor_slices(files).interleave(TFRecordDataset, cycle_length=2, block_length=8)`,
parsed, in batches of 16. One process reads both files, 8 rows of each in turn; two
processes each read their own file (keras_accel shards the pipeline by file), 8 rows a
step each: the same rows in every global batch, so training matches. The evaluation files
end after different numbers of batches in the two processes (4 and 2 of 8 rows).

Then the custom loop (`acc.loop`) trains a second model one epoch over the same files and
evaluates it.

Every row the pipeline parses is counted by its file index (a `tf.py_function` in the
parse), so a test can see which files each process read. Each process writes
WORKDIR/files-<process>.npz: its final weights, losses, evaluation, predictions and the
counts, and the loop's.

On JAX, a third model trains on a Grain `MapDataset` (44 rows in batches of 16: two
processes each read their own 8 rows of every batch, 8 and 4 of the last), then evaluates
and predicts over one of 36 rows (the last batch's 4 rows all process 0's): each row a
process reads is recorded by index (`grain_read` in the npz). The custom loop trains a
fourth model one epoch over the same training set.
"""

import argparse
import collections
import json
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("workdir")
parser.add_argument("--devices", type=int, default=None)
args = parser.parse_args()

import keras_accel  # noqa: E402

if args.devices is not None:
    keras_accel.configure_virtual_cpu_devices(args.devices)

import keras  # noqa: E402
from _model import compiled_classifier  # noqa: E402  (this folder: scripts run as scripts)

from keras_accel import Accelerator  # noqa: E402

acc = Accelerator(seed=0, devices=args.devices)  # Joins the cluster before TF computes.
import tensorflow as tf  # noqa: E402

read = collections.Counter()  # Rows parsed, by file index.


def count(file, y):
    read[int(file.numpy())] += 1
    return y


def parse(record):
    features = tf.io.parse_single_example(
        record,
        {
            "x": tf.io.FixedLenFeature([6], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
            "file": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    y = tf.py_function(count, [features["file"], features["y"]], tf.int64)
    return features["x"], tf.ensure_shape(y, [])


def dataset(kind):
    names = [os.path.join(args.workdir, f"{kind}-{i}.tfrecord") for i in range(2)]
    files = tf.data.Dataset.from_tensor_slices(names)
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=2, block_length=8)
    return records.map(parse).batch(16)


def compiled_model():
    return compiled_classifier(acc)


model = compiled_model()
history = acc.fit(model, dataset("train"), epochs=2, verbose=0)
counts = {"train": dict(read)}
read.clear()
evaluation = acc.evaluate(model, dataset("eval"), verbose=0)
predictions = acc.predict(model, dataset("eval"), verbose=0)
counts["eval"] = dict(read)

# The custom loop over the same files: one epoch, then an evaluation.
read.clear()
looped = compiled_model()
loop = acc.loop(looped)
for batch in loop.batches(dataset("train")):
    loop.train_step(batch)
loop_train = loop.results()
loop_eval = loop.evaluate(dataset("eval"))
counts["loop"] = dict(read)
grained = {}
if keras.backend.backend() == "jax":
    import grain

    class Rows:
        """A random-access source whose reads are recorded (`grain_read`)."""

        def __init__(self, seed, rows):
            generator = np.random.default_rng(seed)
            self.x = generator.normal(size=(rows, 6)).astype("float32")
            self.y = generator.integers(0, 3, size=(rows,)).astype("int32")
            self.read = []

        def __len__(self):
            return len(self.y)

        def __getitem__(self, i):
            self.read.append(int(i))
            return self.x[i], self.y[i]

    train_rows, eval_rows = Rows(20, 44), Rows(21, 36)
    grain_model = compiled_model()
    train_set = grain.MapDataset.source(train_rows).batch(16)
    grain_fit = acc.fit(grain_model, train_set, epochs=2, verbose=0)
    eval_set = grain.MapDataset.source(eval_rows).batch(16)
    eval_x = grain.MapDataset.source(eval_rows).map(lambda row: row[0]).batch(16)
    grained = dict(
        grain_loss=np.asarray(grain_fit.history["loss"]),
        grain_evaluation=np.asarray(acc.evaluate(grain_model, eval_set, verbose=0)),
        grain_predictions=acc.predict(grain_model, eval_x, verbose=0),
        **{f"grain_w{i}": np.asarray(v.value) for i, v in enumerate(grain_model.weights)},
    )
    grain_looped = compiled_model()  # The custom loop over the same batches: one epoch.
    grain_loop = acc.loop(grain_looped)
    for batch in grain_loop.batches(train_set):
        grain_loop.train_step(batch)
    grained["grain_read"] = json.dumps({"train": train_rows.read, "eval": eval_rows.read})
    grained.update(
        {f"grain_loop_w{i}": np.asarray(v.value) for i, v in enumerate(grain_looped.weights)}
    )

me = acc.process_index
np.savez(
    os.path.join(args.workdir, f"files-{me}.npz"),
    loss=np.asarray(history.history["loss"]),
    evaluation=np.asarray(evaluation),
    predictions=predictions,
    loop_train=np.asarray([loop_train["loss"], loop_train["accuracy"]]),
    loop_eval=np.asarray([loop_eval["loss"], loop_eval["accuracy"]]),
    counts=json.dumps({k: {str(f): n for f, n in v.items()} for k, v in counts.items()}),
    **{f"w{i}": np.asarray(v.value) for i, v in enumerate(model.weights)},
    **{f"loop_w{i}": np.asarray(v.value) for i, v in enumerate(looped.weights)},
    **grained,
)
print(f"process {me} of {acc.num_processes}: done", flush=True)
