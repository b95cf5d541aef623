"""Which of a model's compiled losses and metrics padding rows would make inexact.

A padded batch is exact because every loss and metric honours `sample_weight`: padding rows
weigh 0. Keras's own losses and metrics do. Two kinds of user code cannot:

- a loss function that returns one value for the whole batch (`ops.mean(...)`): the mean
  already includes the padding rows, and a weight per row cannot take them out again;
- a metric that ignores `sample_weight` (a hand-written `Metric` whose `update_state`
  drops it, or a metric function returning one value per batch): it counts padding rows.

A third kind is the model itself: a `call` that computes a row's output from the other rows
of its batch (a sum over the batch axis), so that padding rows change the real rows'
outputs; found by running the model on a few real rows with and without padding rows after
them.

Plain Keras is exact on the same data (it never pads), so the Accelerator finds these
before the first step, by running them once on a few real rows of the first batch (a loss's
rank; a metric with some rows weighted 0 against the same metric on the other rows alone),
and then runs the last partial batch unpadded, drops it or refuses, naming them
(`keras_accel.adapter.batches`). Losses and metrics are probed only where they are the
user's; the forward pass of every model whose call pads (two eager calls on at most 16 rows).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import keras
import numpy as np
from keras import ops

from keras_accel.data.batching import pad_rows
from keras_accel.utils import keras_internals

_PROBE_ROWS = 16


@contextlib.contextmanager
def _randomness_kept(model):
    """The probes' forward passes leave every random state as they found it: a layer that
    draws in inference too (keras-io's VAE's `Sampling`) advances its seed generator at
    each call, and a probe's draws would shift every draw of the run after it. The model's
    seed generators, Keras's global one and torch's generator are put back."""
    generators = {id(g): g for g in _seed_generators(model)}
    found = keras_internals.global_seed_generator()
    if found is not None:
        generators[id(found)] = found
    saved = [(g, ops.convert_to_numpy(g.state.value)) for g in generators.values()]
    torch_state = None
    if keras.backend.backend() == "torch":
        import torch

        torch_state = torch.get_rng_state()
    try:
        yield
    finally:
        for generator, state in saved:
            generator.state.assign(state)
        if torch_state is not None:
            import torch

            torch.set_rng_state(torch_state)


def _seed_generators(model):
    for layer in keras_internals.flatten_layers(model):
        for value in vars(layer).values():
            if isinstance(value, keras.random.SeedGenerator):
                yield value


def _probe(function):
    """`function(model, sample)` with the model's randomness kept (`_randomness_kept`)."""

    @functools.wraps(function)
    def probe(model, sample):
        with _randomness_kept(model):
            return function(model, sample)

    return probe


@_probe
def inexact_under_padding(model, sample) -> list[str]:
    """The compiled losses and metrics of `model` that padding rows would reach, each as a
    short description ("loss 'my_loss' returns one value per batch").

    Args:
        sample: a padded batch `(x, y, sample_weight, row_mask)` of numpy arrays.
    """
    losses = [(path, fn) for path, fn in _leaves(getattr(model, "loss", None)) if _user(fn)]
    metrics = []
    for given in keras_internals.compiled_metric_arguments(model):
        metrics += [(path, m) for path, m in _leaves(given) if _user(m)]
    x, y, _, mask = sample
    real = np.flatnonzero(np.asarray(mask) > 0) if mask is not None else None
    rows = real[:_PROBE_ROWS] if real is not None else slice(0, _PROBE_ROWS)
    take = lambda a: np.asarray(a)[rows]  # noqa: E731
    x = keras.tree.map_structure(take, x)
    try:
        y_pred = model(x, training=False)
    except Exception:  # Inputs only a preprocessor understands (keras-hub's raw strings).
        return []
    found = []
    if _mixes_rows(model, x, y_pred):
        found.append(
            f"{type(model).__name__}'s output for a row depends on the other rows of its batch"
        )
    if (not losses and not metrics) or y is None:
        return found
    y = keras.tree.map_structure(take, y)
    if len(keras.tree.flatten(y)[0]) < 2:
        return found
    for path, loss in losses:
        pair = _pair(path, y, y_pred)
        if pair is not None and _returns_scalar(loss, *pair):
            found.append(f"loss {_name(loss)!r} returns one value per batch")
    for path, metric in metrics:
        pair = _pair(path, y, y_pred)
        if pair is not None and _ignores_weights(metric, *pair):
            found.append(f"metric {_name(metric)!r} counts rows whose sample_weight is 0")
    return found


@_probe
def mixes_rows(model, sample) -> bool:
    """Whether `model`'s output for a row depends on the other rows of its batch
    (`_mixes_rows`), probed on a few real rows of `sample` (a padded batch `(x, y,
    sample_weight, row_mask)` of numpy arrays). Two eager forward passes."""
    x, _, _, mask = sample
    real = np.flatnonzero(np.asarray(mask) > 0) if mask is not None else None
    rows = real[:_PROBE_ROWS] if real is not None else slice(0, _PROBE_ROWS)
    x = keras.tree.map_structure(lambda a: np.asarray(a)[rows], x)
    try:
        y_pred = model(x, training=False)
    except Exception:  # Inputs only a preprocessor understands (keras-hub's raw strings).
        return False
    return _mixes_rows(model, x, y_pred)


def _mixes_rows(model, x, y_pred) -> bool:
    """Whether the model's output for a row changes when padding rows (copies of a real
    row, as the feeder pads) follow it in the batch, in inference: a `call` that reduces over
    the batch (keras-io's movie recommender: `ops.tensordot(users, movies, 2)` sums every
    row's products into each output). One more forward pass of a few rows."""
    leaves = keras.tree.flatten(x)
    if not leaves:
        return False
    rows = len(leaves[0])
    padded = keras.tree.map_structure(lambda a: pad_rows(np.asarray(a), 2 * rows), x)
    try:
        with_padding = model(padded, training=False)
    except Exception:  # A model that takes only its own batch shape.
        return False
    for alone, longer in zip(keras.tree.flatten(y_pred), keras.tree.flatten(with_padding)):
        try:
            alone = ops.convert_to_numpy(alone)
            longer = ops.convert_to_numpy(longer)
        except RuntimeError:  # Laid out over other processes' devices too (JAX): no probe.
            return False
        if alone.shape[:1] != (rows,) or longer.shape[:1] != (2 * rows,):
            continue  # Not one output per row: nothing to compare row by row.
        finite = np.abs(alone[np.isfinite(alone)])
        scale = max(1.0, float(finite.max(initial=0.0)))
        # NaN where NaN: a model already broken (weights of NaN) is not one that mixes rows.
        if not np.allclose(alone, longer[:rows], rtol=1e-4, atol=1e-5 * scale, equal_nan=True):
            return True
    return False


def _leaves(structure):
    """(path, leaf) for a compile argument: one object, a list, or a dict by output."""
    if structure is None:
        return []
    if isinstance(structure, dict):
        return [((key, *p), leaf) for key, v in structure.items() for p, leaf in _leaves(v)]
    if isinstance(structure, (list, tuple)):
        out = []
        for i, v in enumerate(structure):
            for p, leaf in _leaves(v):
                # A flat list of metrics applies to the (single) output; nested, per output.
                out.append(((i, *p), leaf) if isinstance(v, (list, tuple, dict)) else (p, leaf))
        return out
    return [((), structure)]


def _user(obj) -> bool:
    """Code that is not Keras's own (whose losses and metrics all honour sample_weight)."""
    if obj is None or isinstance(obj, str):
        return False
    inner = keras_internals.wrapped_function(obj)
    if isinstance(obj, (keras.losses.Loss, keras.metrics.Metric)) and _is_keras(type(obj)):
        return inner is not None and not _is_keras(inner)
    return not _is_keras(obj)


def _is_keras(obj) -> bool:
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return module.split(".")[0] == "keras"


def _pair(path, y, y_pred):
    try:
        for key in path:
            y, y_pred = y[key], y_pred[key]
    except (KeyError, IndexError, TypeError):
        return None
    if isinstance(y, (dict, list, tuple)) or isinstance(y_pred, (dict, list, tuple)):
        return None
    return y, y_pred


def _as_keras_hands_them(y_true, y_pred, dtype=None):
    """Targets and predictions as tensors of the loss's (or metric's) dtype, as Keras hands
    them to a user's function (`Loss.__call__`): numpy targets support no `y_true - y_pred`
    against a torch tensor."""
    dtype = dtype or keras.backend.floatx()
    convert = lambda v: ops.convert_to_tensor(v, dtype=dtype)  # noqa: E731
    return keras.tree.map_structure(convert, y_true), keras.tree.map_structure(convert, y_pred)


def _returns_scalar(loss, y_true, y_pred) -> bool:
    y_true, y_pred = _as_keras_hands_them(y_true, y_pred, getattr(loss, "dtype", None))
    if isinstance(loss, keras.losses.Loss):
        inner = keras_internals.wrapped_function(loss)
        kwargs = keras_internals.wrapped_kwargs(loss)
        values = inner(y_true, y_pred, **kwargs) if inner is not None else loss.call(y_true, y_pred)
    else:
        values = loss(y_true, y_pred)
    return _batch_scalar(values)


def _batch_scalar(values) -> bool:
    """One value for the whole batch, computed from it. A Python number (Keras's trainer
    tests' `lambda y_true, y_pred: 1.0`, which Keras takes) is a constant: a mean of it,
    weighted or not, is the same number, so padding rows cannot change it."""
    if isinstance(values, (int, float, np.number)) or values is None:
        return False
    return len(ops.shape(values)) == 0


def _ignores_weights(metric, y_true, y_pred) -> bool:
    if not isinstance(metric, keras.metrics.Metric):
        # A function: Keras averages what it returns.
        values = metric(*_as_keras_hands_them(y_true, y_pred))
        return _batch_scalar(values)
    # The real rows alone, against the real rows and rows weighted 0 after them: rows with
    # shifted labels, rows with shifted predictions (either may happen to score like the
    # real ones; both rarely), and rows whose predictions are moved off the real ones' (a
    # metric of the predictions' mean or sum: shifted rows keep both).
    alone = _result(metric, y_true, y_pred, None)
    if alone is None:
        return False  # Nothing to probe it with.
    rows = len(y_true)
    weights = np.concatenate([np.ones(rows, "float32"), np.zeros(rows, "float32")])
    y_true_np, y_pred_np = np.asarray(y_true), ops.convert_to_numpy(y_pred)
    moved = y_pred_np
    if y_pred_np.dtype.kind == "f":
        moved = np.flip(y_pred_np, axis=-1) * np.asarray(0.5, y_pred_np.dtype) + 0.25
    for junk_true, junk_pred in (
        (np.roll(y_true_np, 1, axis=0), y_pred_np),
        (y_true_np, np.roll(y_pred_np, 1, axis=0)),
        (y_true_np, moved),
    ):
        try:
            padded = _result(
                metric,
                np.concatenate([y_true_np, junk_true]),
                np.concatenate([y_pred_np, junk_pred]),
                weights,
            )
        except Exception:  # Predictions it refuses (out of its range): not a probe of it.
            continue
        if padded is not None and not all(
            np.allclose(u, v, rtol=1e-5, atol=1e-6) for u, v in zip(padded, alone)
        ):
            return True
    return False


def _result(metric, y_true, y_pred, sample_weight):
    fresh = _fresh(metric)
    if fresh is None:
        return None
    fresh.update_state(y_true, y_pred, sample_weight=sample_weight)
    return [ops.convert_to_numpy(v) for v in keras.tree.flatten(fresh.result())]


def _fresh(metric):
    """A copy of `metric` with its own state, made outside any strategy scope."""
    try:
        fresh = type(metric).from_config(metric.get_config())
    except Exception:
        try:
            fresh = copy.deepcopy(metric)
        except Exception:
            return None
    fresh.reset_state()
    return fresh


def _name(obj) -> str:
    return getattr(obj, "name", None) or getattr(obj, "__name__", None) or type(obj).__name__
