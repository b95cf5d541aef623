"""Shared test helpers: tiny models and data, and readers of what really ran."""

import doctest
import gc
import importlib
import inspect
import os
import time

import keras
import numpy as np

# Replicas for a test whose subject is not the replica count (a callback, an input's
# structure, what a call leaves behind): TensorFlow traces every step once per replica, and
# an 8-replica fit of the MLP here costs about four times a 2-replica one (16 s against 4 s,
# 2 December 2026, this 2-core machine). Two replicas still take every cross-replica path
# (reductions, padding to a replica multiple, mirrored variables, synchronized statistics);
# the tests whose subject is the replica count use every device.
FEW_REPLICAS = min(2, int(os.environ.get("KERAS_ACCEL_TEST_DEVICES", "8")))


def mlp(inputs=6, classes=3, batchnorm=True, dropout=False, regularize=False, seed=0):
    reg = keras.regularizers.L2(1e-3) if regularize else None
    init = keras.initializers.GlorotUniform(seed=seed)
    layers = [
        keras.Input((inputs,)),
        keras.layers.Dense(16, kernel_initializer=init, kernel_regularizer=reg),
    ]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization())
    layers.append(keras.layers.ReLU())
    if dropout:
        layers.append(keras.layers.Dropout(0.5))
    layers.append(
        keras.layers.Dense(
            classes,
            activation="softmax",
            kernel_initializer=keras.initializers.GlorotUniform(seed + 1),
        )
    )
    return keras.Sequential(layers)


def compiled_mlp(optimizer="sgd", **kwargs):
    model = mlp(**kwargs)
    model.compile(
        optimizer=optimizer,
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")],
    )
    return model


def data(n=101, inputs=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, inputs)).astype("float32")
    y = (x[:, 0] > 0).astype("int64") + (x[:, 1] > 0.5).astype("int64")
    return x, np.minimum(y, classes - 1)


def collect_until(done, timeout_s=30.0):
    """gc.collect() until `done()`: a Keras model lives in reference cycles, and gc.collect()
    returns at once, collecting nothing, while another thread's collection runs (CPython's
    `collecting` flag; TensorFlow's and tf.data's threads allocate all the time). Seen once in
    a full TF run of the suite, never alone."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        if done() or time.monotonic() > deadline:
            return
        time.sleep(0.05)


def unpadded_remainder(acc) -> bool:
    """Whether `acc` runs a last partial batch unpadded where padding would reach code that
    weights no rows (docs/accelerator.md, "Padded, unpadded or dropped"): on one replica, on
    JAX, whose one program cuts it to its real rows, and over torch's processes and
    TensorFlow's replicas, each of which runs it whole (numeric arrays; elsewhere it is
    dropped in training, or refused in evaluation)."""
    return acc.num_replicas == 1 or keras.backend.backend() in ("jax", "torch", "tensorflow")


def unpadded_stream(acc, kind="generator") -> bool:
    """Whether `acc` runs the short batches of a stream (a generator, a `PyDataset`, a
    tf.data pipeline: `kind`) unpadded where padding would reach code that weights no rows:
    on one replica, on JAX (a tf.data pipeline: in one process), over TensorFlow's replicas
    (each reads it whole, from the host) and over torch's processes (not a tf.data
    pipeline: there its short batch is dropped in training, an evaluation refused)."""
    if acc.num_replicas == 1:
        return True
    return keras.backend.backend() in ("jax", "tensorflow") or kind != "tf.data"


def keep_pair(out, name, what, ours, one):
    """`ours` and plain Keras's `one` (structures of arrays) into `out`, leaf by leaf, as
    "<name>/<what>.<i>/ours" and ".../one": what a multi-process script saves and its test
    compares (tests/adapter/test_torch_replicated.py's `compare`)."""
    for i, (a, b) in enumerate(zip(keras.tree.flatten(ours), keras.tree.flatten(one))):
        out[f"{name}/{what}.{i}/ours"] = np.asarray(a)
        out[f"{name}/{what}.{i}/one"] = np.asarray(b)


def weights_of(model):
    return [np.asarray(w) for w in model.get_weights()]


def assert_weights_close(a, b, atol=1e-5):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        np.testing.assert_allclose(u, v, atol=atol, rtol=1e-5, err_msg=f"weight {i}")


def per_replica_values(variable):
    """Each replica's copy of a variable, as numpy arrays (TF MirroredVariable or JAX shards)."""
    value = variable.value
    if hasattr(value, "values") and not hasattr(value, "addressable_shards"):
        return [np.asarray(v) for v in value.values]
    if hasattr(value, "addressable_shards"):
        return [np.asarray(s.data) for s in value.addressable_shards]
    return [np.asarray(value)]


def assert_replicas_agree(variables, replicas, exact=False):
    """Every replica holds the same value of each variable (`per_replica_values`).

    `exact` for what a decision sets (a loss scale, a step counter); otherwise the weights'
    tolerance of the suite's other per-replica checks.
    """
    for variable in variables:
        copies = per_replica_values(variable)
        assert len(copies) == replicas, (variable.path, len(copies))
        for i, copy in enumerate(copies[1:], start=1):
            message = f"{variable.path}: replica {i} differs from replica 0"
            if exact:
                np.testing.assert_array_equal(copy, copies[0], err_msg=message)
            else:
                np.testing.assert_allclose(copy, copies[0], rtol=1e-6, atol=1e-7, err_msg=message)


def run_docstring_examples(name):
    """Run the docstring examples of module `name` and of the classes and functions it exports.

    `doctest.testmod` sees only what the module itself defines, so a package that re-exports
    its classes (`keras_accel.callbacks`) yields no examples and passes while checking nothing;
    this walks the module and each class or function in its `__all__` with `DocTestFinder`,
    runs every example once, and fails when no example was found as well as when one fails.
    """
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder()
    found = finder.find(module)
    for attr in getattr(module, "__all__", ()):
        obj = getattr(module, attr)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            found += finder.find(obj, f"{name}.{attr}")
    tests, seen = [], set()
    for test in sorted(found, key=lambda t: (t.filename or "", t.lineno or 0, t.name)):
        where = (test.filename, test.lineno, test.docstring)
        if test.examples and where not in seen:
            seen.add(where)
            tests.append(test)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted > 0, f"{name}: no docstring examples found in it or its exports"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed"
    return result


class Interrupt(keras.callbacks.Callback):
    """Ends a fit with KeyboardInterrupt as `epoch` begins (after the backups before it)."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt


def library_state(prefixes=("keras", "tensorflow", "jax")):
    """What every class and module of Keras, TensorFlow and JAX holds, as `{(owner, name,
    is_class): id(value)}`: the classes and modules loaded now, their own attributes
    (`vars`). Compare two with `changed_library_state`."""
    import sys

    state = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        try:
            namespace = dict(vars(module))
        except TypeError:
            continue
        for name, value in namespace.items():
            state[(module_name, name, False)] = id(value)
            if isinstance(value, type) and value.__module__ == module_name:
                owner = f"{module_name}.{value.__qualname__}"
                for attribute, member in list(vars(value).items()):
                    state[(owner, attribute, True)] = id(member)
    return state


def changed_library_state(before, after):
    """What `after` (a `library_state`) changed of `before`: `[(owner, name)]` replaced or
    removed, and added to a class (which shadows what it inherits). Names added to a module
    since (a submodule imported for the first time) are not changes to what it had."""
    changed = {key[:2] for key, value in before.items() if after.get(key) != value}
    classes = {key[0] for key in before if key[2]}
    added = (key for key in after.keys() - before.keys() if key[2] and key[0] in classes)
    # Caches Python adds to a class when first asked: an empty `__annotations__` (3.10+),
    # copyreg's `__slotnames__` (a first copy or pickle of an instance).
    changed |= {key[:2] for key in added if key[1] not in ("__annotations__", "__slotnames__")}
    return sorted(changed)


class Batches(keras.utils.PyDataset):
    """(x, y) batches of `batch_size` rows, in order, the last one short."""

    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def timed_ways(monkeypatch, plain: float, compiled: float, compile_s: float = 0.0, tmp_path=None):
    """The compiled-or-plain trial (`keras_accel.adapter.choice`) as if every unit took
    `plain` or `compiled` seconds a step (plus `compile_s` for the compiled way's first),
    whatever it really took, starting at once: what a test of the choice needs to decide
    the same way on a loaded machine. Decisions are kept in no file, or in one under
    `tmp_path`; none from an earlier test is remembered. Returns the list of every
    `(way, steps)` unit recorded. The trial needs no time at stake
    (`choice.TRIAL_RISK_STEPS`)."""
    from keras_accel.adapter import choice, choice_cache

    units = []
    record = choice.Choice.record

    def fake(self, path, seconds, steps):
        units.append((path, steps))
        first = path == choice.COMPILED and self._first[choice.COMPILED]
        per = plain if path == choice.PLAIN else compiled
        return record(self, path, per * steps + (compile_s if first else 0.0), steps)

    monkeypatch.setattr(choice.Choice, "record", fake)
    monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_AFTER", "0")
    monkeypatch.setattr(choice, "TRIAL_RISK_STEPS", 0)  # These small fits have little at stake.
    if tmp_path is None:
        monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_CACHE", "0")
    else:
        monkeypatch.setenv("KERAS_ACCEL_JIT_COMPILE_CACHE", "1")
        monkeypatch.setattr(choice_cache, "path", lambda: str(tmp_path / "compile_choices.json"))
    choice_cache.forget()
    monkeypatch.setattr(choice_cache, "_DECISIONS", {})
    return units


def timeseries_classifier(blocks=2, steps=16, classes=2):
    """keras-io's timeseries classifier (timeseries/timeseries_classification_from_scratch.py)
    in small: Conv1D -> BatchNormalization -> ReLU blocks, GlobalAveragePooling1D, a softmax
    Dense, Adam, seeded. Its Conv1D layers pad nothing and have no bias, so that the moments
    are what a comparison sees: with `padding="same"` the zero-padded edges' outputs, far
    from the others on `series_far_from_zero`, would make the spread; and a bias before
    BatchNormalization has a gradient that is rounding noise (the layer subtracts the
    mean), which Adam scales up to steps of its learning rate, in any two summation orders
    otherwise."""
    inputs = keras.Input((steps, 1))
    outputs = inputs
    for i in range(blocks):
        init = keras.initializers.GlorotUniform(seed=i)
        if i == 0:  # Taps of one sign: the outputs keep the inputs' mean far from zero.
            init = keras.initializers.RandomUniform(0.1, 0.5, seed=i)
        outputs = keras.layers.Conv1D(8, 3, use_bias=False, kernel_initializer=init)(outputs)
        outputs = keras.layers.BatchNormalization()(outputs)
        outputs = keras.layers.ReLU()(outputs)
    outputs = keras.layers.GlobalAveragePooling1D()(outputs)
    init = keras.initializers.GlorotUniform(seed=blocks)
    outputs = keras.layers.Dense(classes, activation="softmax", kernel_initializer=init)(outputs)
    model = keras.Model(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(1e-3),
        "sparse_categorical_crossentropy",
        metrics=["sparse_categorical_accuracy"],
    )
    return model


def series_far_from_zero(n=45, steps=16, mean=100.0, seed=0):
    """`n` series of `steps` values around `mean` (spread 1), and a class for each: data whose
    mean is large beside its spread, where a variance taken as E[x^2] - E[x]^2 loses most of
    its digits to rounding (the mean of squared deviations keeps them)."""
    rng = np.random.default_rng(seed)
    x = (mean + rng.normal(size=(n, steps, 1))).astype("float32")
    y = (x[:, :4, 0].mean(axis=1) > mean).astype("int32")
    return x, y


class Noise(keras.layers.Layer):
    """Gaussian noise in training, as a layer of the user's draws it (keras-io's VAE's
    `Sampling` style: a seed generator it holds, `keras.random.normal` of its input's shape)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(11)

    def call(self, x, training=False):
        if not training:
            return x
        return x + 0.1 * keras.random.normal(keras.ops.shape(x), seed=self.seed_generator)


class BatchesOf(keras.utils.PyDataset):
    """`x` and `y` in batches of `batch_size`, the last one short: a user's `PyDataset`."""

    def __init__(self, x, y, batch_size: int):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, i):
        cut = slice(i * self.batch_size, (i + 1) * self.batch_size)
        return self.x[cut], self.y[cut]


def stream(kind: str, x, y, batch_size: int):
    """`x` and `y` in batches of `batch_size` (the last one short), read as they come: a
    "PyDataset", a "tf.data" data set, or (anything else) a generator."""
    if kind == "PyDataset":
        return BatchesOf(x, y, batch_size)
    if kind == "tf.data":
        import tensorflow as tf

        return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
    return ((x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size))
