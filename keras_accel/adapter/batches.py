"""The batches of one `fit`, `evaluate` or `predict`: the feeder's static batches
(`keras_accel.adapter.feeder`), checked so that padding never changes a result. Padding rows
reach the step weighted 0 where every loss and metric honours that
(`keras_accel.adapter.exactness`); where it cannot (no targets, a step or `compute_loss` of
the user's that is not given the weights, `add_loss`, a loss or metric that ignores them:
`keras_accel.adapter.unweighted`) the last partial batch reaches the model's code unpadded
where the runtime can run it so (`Runtime.whole_remainder`: one replica, JAX, torch's
processes, a MirroredStrategy's replicas; for a stream read in Python, as each batch comes,
`Runtime.whole_stream_remainder`; for a user's tf.data pipeline,
`Runtime.whole_pipeline_remainder`), and
elsewhere training drops it with a note saying why and how to keep it, and an evaluation
that would count padding is refused, naming what would. Also each kind's `StepContract`:
what its step is given."""

from __future__ import annotations

import warnings
import weakref

from keras_accel.adapter.exactness import inexact_under_padding, mixes_rows
from keras_accel.adapter.feeder import Feeder, user_stacklevel
from keras_accel.adapter.pipeline import preprocessor, with_made_targets
from keras_accel.adapter.runtime import Runtime
from keras_accel.adapter.steps import StepContract, honours_sample_weight, overrides
from keras_accel.adapter.unweighted import unweighted_code
from keras_accel.data import sources
from keras_accel.utils import keras_internals


class Batches:
    """The batches of a call over `num_replicas` replicas, with the Accelerator's training
    `remainder` policy (None: pad, or drop with a note where padding cannot be exact)."""

    def __init__(self, feeder: Feeder, remainder: str | None, num_replicas: int):
        self.feeder = feeder
        self.remainder = remainder
        self.num_replicas = num_replicas

    def training(self, model, x, y, batch_size, shuffle, sample_weight, class_weight, kind):
        """The training batches, with the remainder policy for steps that cannot be told
        which rows are padding: without targets nothing weights padding out of a loss, and a
        model's own `train_step` without the user's weights gets `(x, y)`, as in Keras."""

        made: list = []

        def make(remainder):
            if made and _read_once(made[0]):
                batches = made[0].with_remainder(remainder)
            else:
                batches = self.feeder.batches(
                    x,
                    y,
                    batch_size,
                    shuffle,
                    sample_weight,
                    class_weight,
                    True,
                    remainder,
                    True,
                    kind,
                )
            made.append(batches)
            return with_made_targets(batches, preprocessor(model))

        batches = make(self.remainder or "pad")
        self._check_shares(model, batches)
        builtin = not overrides(model, "train")
        if builtin and not batches.has_targets and keras_internals.compile_loss(model):
            raise ValueError(
                f"{type(model).__name__} was compiled with a loss, which needs targets, but "
                "fit got none. Received: y=None. Pass y (or a data set that yields (x, y)), "
                "or compile without `loss=` if the model adds its own losses (add_loss)."
            )
        # A step of the user's is given padding rows (weighted 0) if it honours weights.
        custom = not builtin and not batches.weighted and not honours_sample_weight(model)
        # Code of the user's that computes over every row of the batch: a compute_loss
        # that drops sample_weight, add_loss (`keras_accel.adapter.unweighted`).
        unweighted = unweighted_code(model, "train") if batches.plan.pads else []
        blind = not batches.has_targets or custom or bool(unweighted)
        if not blind and batches.plan.pads and builtin:
            return self._exact_training(model, batches, make, kind)
        if not blind or not batches.plan.pads:
            return batches
        plan = batches.plan
        if not batches.has_targets:
            reason = "there are no targets to weight padding rows out of the loss"
        elif custom:
            reason = f"{type(model).__name__} overrides train_step and gets (x, y) batches"
        else:
            reason = "; ".join(unweighted)
        if self.remainder is None and plan.static_rows == plan.batch_size:
            whole = self._whole(make, plan, reason, kind, model)
            if whole is not None:
                return whole
            return _dropped(
                make,
                plan,
                f"{reason}, so the last partial batch",
                "Pass Accelerator(remainder='pad') to feed it padded, weighted 0 in "
                "sample_weight (your code must then honour sample_weight), or a batch_size "
                "that divides the data.",
            )
        if self.remainder == "pad" and batches.has_targets:
            return batches  # Asked for: padding reaches the step as sample_weight 0.
        raise ValueError(
            f"keras_accel: {reason}, but {plan.describe()} over {self.num_replicas} replicas "
            f"{'need' if plan.num_samples is not None else 'may need'} padding rows in "
            f"{'every batch' if plan.static_rows != plan.batch_size else 'the last batch'}. "
            f"Use a batch_size that is a multiple of {self.num_replicas}"
            + (" (the last partial batch is then dropped)" if batches.has_targets else "")
            + (
                ", or Accelerator(remainder='pad') to pass padding rows to the step with "
                "sample_weight 0 (the step must honour sample_weight)."
                if batches.has_targets
                else "; and pass y, or remainder='drop'."
            )
        )

    def evaluation(self, model, x, y, batch_size, sample_weight, kind, name: str, call: str):
        """Every row of `x` once, the last batch padded, for `evaluate` (or fit's validation:
        `name` is the argument, `call` what the refusal names): refused where padding would
        count in the loss or a metric, or where there are no targets to weight it out."""

        made: list = []

        def make(remainder):
            if made and _read_once(made[0]):  # A generator: its first batch is read.
                batches = made[0].with_remainder(remainder)
            else:
                batches = self.feeder.batches(
                    x, y, batch_size, False, sample_weight, None, False, remainder, True, kind
                )
            made.append(batches)
            return with_made_targets(batches, preprocessor(model))

        batches = make(None)
        self._check_shares(model, batches)
        found = self._blind_evaluation(model, batches)
        if found and batches.plan.static_rows == batches.plan.batch_size:
            whole = self._whole(make, batches.plan, "; ".join(found), kind, model)
            if whole is not None:
                return whole
        _check_evaluation(batches, name)
        if found:
            raise ValueError(_inexact_message(found, batches.plan, self.num_replicas, f"`{call}`"))
        return batches

    def prediction(self, x, batch_size, kind):
        """Every row of `x` once, the last batch padded (the row mask says which are real)."""
        return self.feeder.batches(x, None, batch_size, False, None, None, False, None, True, kind)

    def contract(self, batches) -> StepContract:
        """What the step of `batches` is given: weights where there are targets and either
        the user's weights or padding."""
        plan = batches.plan
        if plan.static_rows != plan.batch_size:
            padding = f", each padded to {plan.static_rows} rows for {self.num_replicas} replicas"
        else:
            padding = f" over {self.num_replicas} replica(s)"
        return StepContract(
            pass_weights=batches.has_targets and (batches.weighted or plan.pads),
            user_weighted=batches.weighted,
            padded=plan.pads,
            replicated=plan.remainder == "replicate",
            description=f"{plan.describe()}{padding}",
        )

    def _exact_training(self, model, batches, make, kind):
        """Padded training batches, unless a loss or metric of the user's cannot weight the
        padding rows out (`keras_accel.adapter.exactness`): then the last partial batch runs
        unpadded where the runtime can (`_whole`), or is dropped with a note, where dropping
        it removes all padding, or the fit is refused."""
        found = inexact_under_padding(model, sources.sample_batch(batches))
        if not found:
            return batches
        plan = batches.plan
        if self.remainder is None and plan.static_rows == plan.batch_size:
            whole = self._whole(make, plan, "; ".join(found), kind, model)
            if whole is not None:
                return whole
            return _dropped(
                make,
                plan,
                f"{'; '.join(found)}, so padding rows would change it: the last partial batch",
                "Every batch is then exact. Honour sample_weight (or return one loss per "
                "row) to keep it.",
            )
        raise ValueError(_inexact_message(found, plan, self.num_replicas, "training"))

    def _check_shares(self, model, batches) -> None:
        """Says once per model, where each replica runs its own program on its share of
        every batch (`Runtime.whole_remainder` "replicate": torch's processes, a
        MirroredStrategy's replicas), that a model whose `call` mixes the rows of its batch
        (`exactness.mixes_rows`, keras-io's movie recommender) computes every row from its
        share's rows alone there, where plain Keras on one device and JAX see the whole
        batch. Probed once per model (two eager forward passes on a few rows)."""
        if self.feeder.runtime.whole_remainder != "replicate" or self.num_replicas < 2:
            return
        if model in _PROBED_SHARES:
            return
        _PROBED_SHARES.add(model)
        with self.feeder.runtime.scope():  # A model not built yet is built as fit builds it.
            mixed = mixes_rows(model, sources.sample_batch(batches))
        if mixed:
            warnings.warn(
                f"keras_accel: {type(model).__name__}'s output for a row depends on the other "
                f"rows of its batch, and over {self.num_replicas} replicas each computes "
                "from its own share of every batch: its losses, metrics, predictions and "
                "training differ from plain Keras on one device. Compute each row from its "
                "own inputs, or run it on one device or on JAX (KERAS_BACKEND=jax), whose "
                "program sees the whole batch.",
                stacklevel=user_stacklevel(),
            )

    def _blind_evaluation(self, model, batches) -> list[str]:
        """What of the model would count an evaluation's padding rows as real ones, each in
        words; empty where nothing pads or everything weights them out. Without targets
        nothing weights them out (`_check_evaluation` says so where they cannot run whole);
        a model's own `test_step` that reads no weights cannot take them (Keras gives it
        `(x, y)`); code of the model's own that computes over every row
        (`keras_accel.adapter.unweighted`); a compiled loss or metric that ignores them
        (`keras_accel.adapter.exactness`)."""
        if not batches.plan.pads:
            return []
        if not batches.has_targets:
            return ["there are no targets to weight padding rows out"]
        custom = overrides(model, "test")
        if custom and not batches.weighted and not honours_sample_weight(model, "test"):
            return [f"{type(model).__name__} overrides test_step and gets (x, y) batches"]
        found = unweighted_code(model, "test")
        if found or custom:
            return found
        return inexact_under_padding(model, sources.sample_batch(batches))

    def _whole(self, make, plan, reason: str, kind, model):
        """The batches with their short last batch reaching the model's code unpadded, as
        its real rows alone (compiled once more, for its shape), where the runtime runs one
        (`Runtime.whole_remainder`) and the input is numeric arrays read a batch at a time,
        or a stream (`Runtime.whole_stream_remainder`: a generator, a `PyDataset`, each
        batch with padding marked as it comes; `Runtime.whole_pipeline_remainder`: a
        tf.data pipeline, marked in its graph); text and keras-hub preprocessing are padded
        in the arrays' tf.data pipelines: else None. Said once."""
        runtime = self.feeder.runtime
        if preprocessor(model) is not None:
            return None
        if kind in _STREAMS:
            if kind == sources.TF_DATASET:
                mode = runtime.whole_pipeline_remainder
            else:
                mode = runtime.whole_stream_remainder
            if mode is None:
                return None
            whole = make(mode)
            if not _numeric(sources.sample_batch(whole)):
                return None
            # Several replicas of a tf.data pipeline: it is read on the host, a batch per
            # step (`replicated.HostStream`), without tf.distribute's reads ahead.
            on_host = kind == sources.TF_DATASET and mode == "replicate"
            warnings.warn(
                f"keras_accel: {reason}; a batch of {plan.describe()} that is not full (its "
                "last, if it has one) runs unpadded, as a batch of its real rows, as plain "
                f"Keras runs it{_replicated(mode, self.num_replicas)} (one more compilation, "
                "for its shape"
                + ("; the pipeline is read on the host, a batch per step" if on_host else "")
                + ").",
                stacklevel=user_stacklevel(),
            )
            return whole
        mode = runtime.whole_remainder
        if mode is None or kind != sources.ARRAYS:
            return None
        whole = make(mode)
        if not Runtime.numeric_arrays(whole, array_likes=True):
            return None
        rows = whole.plan.remainder_rows
        if rows is None:
            return None
        warnings.warn(
            f"keras_accel: {reason}; the last partial batch ({rows} of "
            f"{whole.plan.num_samples} rows) runs unpadded, as a batch of its real rows, as "
            f"plain Keras runs it{_replicated(mode, self.num_replicas)} (one more "
            "compilation, for its shape; a step per host call).",
            stacklevel=user_stacklevel(),
        )
        return whole


# Models probed for rows that mix across a split batch (`Batches._check_shares`).
_PROBED_SHARES: weakref.WeakSet = weakref.WeakSet()

# Streams whose short batches are marked as they are padded: read in Python, batch by batch,
# or a user's tf.data pipeline, in its graph.
_STREAMS = (sources.GENERATOR, sources.PY_DATASET, sources.TF_DATASET)


def _numeric(batch) -> bool:
    import numpy as np

    from keras_accel.data.batching import flatten

    return all(np.asarray(a).dtype.kind in "biuf" for a in flatten(batch) if a is not None)


def _replicated(mode: str, num_replicas: int) -> str:
    """Where every replica runs the short batch whole (`remainder="replicate"`), in words for
    the note that says so; else nothing."""
    if mode != "replicate":
        return ""
    return f", whole in each of the {num_replicas} replicas"


def _read_once(batches) -> bool:
    """Whether `batches` come from a source that cannot be read again from its start (a
    generator), which made anew would lose the first batch they read to learn its size."""
    return isinstance(batches, sources.IterableBatches) and not batches.reiterable


def _dropped(make, plan, what: str, advice: str):
    """Training batches without the last partial batch, with a one-line note saying why
    (`what` ends in "the last partial batch") and how to keep it."""
    dropped = make("drop")
    if plan.num_samples is None:  # A stream: a partial batch is known only when it comes.
        detail = f"of {plan.describe()}, if it has one,"
    else:
        rows = plan.num_samples - dropped.plan.rows_seen
        detail = f"({rows} of {plan.num_samples} rows, a new draw every epoch when shuffling)"
    warnings.warn(
        f"keras_accel: {what} {detail} is dropped (remainder='drop'). {advice}",
        stacklevel=user_stacklevel(),
    )
    return dropped


def _inexact_message(found: list[str], plan, num_replicas: int, what: str) -> str:
    return (
        f"keras_accel: {'; '.join(found)}, and {what} pads its batches ({plan.describe()} "
        f"over {num_replicas} replicas), so the result would count padding rows, where plain "
        "Keras is exact. Make each honour sample_weight (a loss returning one value per row; "
        "a metric, compute_loss, compute_metrics or test_step handing sample_weight on: "
        "`x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)`), or use a "
        f"batch_size that is a multiple of {num_replicas} and divides the number of rows, so "
        "that nothing is padded (the last partial batch of numeric arrays, a generator or "
        "a PyDataset runs unpadded on one device, on JAX, over torch's processes and over "
        "MirroredStrategy's replicas; a tf.data.Dataset's on one device, on JAX in one "
        "process and over MirroredStrategy's replicas)."
    )


def _check_evaluation(batches, name: str) -> None:
    if not batches.has_targets and batches.plan.pads:
        plan = batches.plan
        raise ValueError(
            f"Without targets, padding rows cannot be weighted out of an evaluation, but "
            f"`{name}` is {plan.describe()}, which "
            f"{'need' if plan.num_samples is not None else 'may need'} padding over the "
            "replicas. Pass targets, or a batch_size that divides the number of rows and is "
            "a multiple of the replica count (for a tf.data.Dataset, "
            "`batch(n, drop_remainder=True)` with such an n)."
        )
