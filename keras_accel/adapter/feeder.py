"""The feeder: what turns every input a user passes (arrays, tf.data, PyDatasets, Python
generators, Grain) into static batches of one Accelerator's replica count, with the row mask
that says which rows are padding. `Accelerator.fit`/`evaluate`/`predict`/`dataset` and
`acc.loop` take their batches from it (`Accelerator.feeder`); the backend runtime then puts
them on the devices."""

from __future__ import annotations

import dataclasses
import warnings

from keras_accel.data import sources
from keras_accel.data.batching import UNPADDED

DEFAULT_BATCH_SIZE = 32  # Keras's own default for array inputs.


class Feeder:
    """Static batches for `num_replicas` replicas over `num_processes` processes."""

    def __init__(self, runtime, num_replicas: int, num_processes: int, seed: int | None):
        self.runtime = runtime
        self.num_replicas = num_replicas
        self.num_processes = num_processes
        self.seed = seed

    def batches(
        self,
        x,
        y,
        batch_size,
        shuffle,
        sample_weight,
        class_weight,
        training,
        remainder,
        own_files=False,
        kind: str | None = None,
    ):
        """The static batches of one input: `x` (arrays, a tf.data.Dataset, a PyDataset,
        a Python generator or a Grain data set) with its targets and weights, for training
        (`remainder` says what a short last batch does) or for evaluation and prediction
        (every row, the last batch padded). `own_files`: several processes each read their
        own files of a file-backed tf.data pipeline, or their own rows of a batched Grain
        `MapDataset`, where they all can. `kind`: what `x` is (`sources.classify`), where
        the caller has classified it already; else classified here, once."""
        if kind is None:
            kind = sources.classify(x)
        if not training and remainder not in UNPADDED:
            remainder = "pad"  # Evaluation and prediction must see every row.
        if kind != sources.ARRAYS:
            if class_weight is not None and kind not in (sources.TF_DATASET, sources.PY_DATASET):
                name = "Python generator" if kind == sources.GENERATOR else type(x).__name__
                raise ValueError(  # Keras's own words, for the inputs Keras refuses it too.
                    f"Argument `class_weight` is not supported for {name} inputs. Return "
                    "(x, y, sample_weight) batches from it instead, or pass a tf.data."
                    f"Dataset or a keras.utils.PyDataset. Received: class_weight={class_weight}"
                )
            if kind == sources.TF_DATASET:  # Keras's words, and whether it is batched.
                from keras_accel.data import tfdata

                tfdata.check_arguments(x, y, batch_size, sample_weight)
            extra = {"y": y, "batch_size": batch_size, "sample_weight": sample_weight}
            given = [name for name, value in extra.items() if value is not None]
            if given:
                raise ValueError(
                    f"With a {type(x).__name__} input, pass targets and weights inside the "
                    f"data set and leave the batching to it. Received also: {', '.join(given)}."
                )
        if kind == sources.TF_DATASET:
            from keras_accel.data import tfdata

            batches = tfdata.TFDatasetBatches(
                x,
                num_replicas=self.num_replicas,
                remainder=remainder,
                training=training,
                class_weight=class_weight,
            )
            if own_files and self.num_processes > 1:
                # Every process reads its own files where it can (all must agree on it):
                # fit, evaluate and predict, which feed the Accelerator's own steps.
                batches.own_files = self.runtime.own_files(batches)
                if batches.own_files is not None:
                    # A process that ran out feeds padding: the step must read the mask. The
                    # pipeline's cardinality counts its global batches, not the steps: those
                    # end with the longest process's files, known only when they end.
                    batches.plan = dataclasses.replace(batches.plan, pads=True, num_batches=None)
        elif kind == sources.PY_DATASET:
            batches = sources.PyDatasetBatches(
                x,
                num_replicas=self.num_replicas,
                remainder=remainder,
                training=training,
                shuffle=shuffle,
                seed=self.seed,
                class_weight=class_weight,
            )
        elif kind in sources.STREAMS:
            batches = None
            if own_files and self.num_processes > 1 and kind == sources.GRAIN:
                # Every process reads only its rows of each batch where it can (all agree).
                batches = self.runtime.own_rows(x, self.num_replicas, remainder, training)
            if batches is None:
                batches = sources.IterableBatches(
                    x,
                    num_replicas=self.num_replicas,
                    remainder=remainder,
                    training=training,
                    kind=kind,
                )
        else:
            if x is None:
                raise ValueError(f"`x` is required. Supported inputs: {sources.SUPPORTED_INPUTS}.")
            batches = sources.ArrayBatches(
                x,
                y,
                sample_weight,
                batch_size=DEFAULT_BATCH_SIZE if batch_size is None else batch_size,
                num_replicas=self.num_replicas,
                shuffle=shuffle,
                remainder=remainder,
                training=training,
                seed=self.seed,
                class_weight=class_weight,
            )
        _warn_if_indivisible(batches.plan.batch_size, batches.plan.static_rows, self.num_replicas)
        return batches


# (batch_size, replicas) pairs whose small-batch note this process has printed.
_SMALL_BATCH_NOTES: set[tuple[int, int]] = set()


def _warn_if_indivisible(batch_size: int, static_rows: int, num_replicas: int) -> None:
    if batch_size < num_replicas:
        # Keras's own tests and small-data users meet this at every call: said once.
        if (batch_size, num_replicas) in _SMALL_BATCH_NOTES:
            return
        _SMALL_BATCH_NOTES.add((batch_size, num_replicas))
        warnings.warn(
            f"keras_accel: batch_size={batch_size} is smaller than the {num_replicas} "
            f"replicas; every batch is padded to {static_rows} rows of weight 0 (the "
            f"results are those of the real rows, but {num_replicas - batch_size} of "
            f"{num_replicas} replicas compute on padding only). Use a batch_size that is a "
            f"multiple of {num_replicas} to use every replica.",
            stacklevel=user_stacklevel(),
        )
    elif static_rows != batch_size:
        warnings.warn(
            f"keras_accel: batch_size={batch_size} does not split over {num_replicas} "
            f"replicas; every batch is padded to {static_rows} rows "
            f"({(static_rows - batch_size) / static_rows:.0%} of the compute is padding). "
            f"Use a multiple of {num_replicas} to avoid it.",
            stacklevel=user_stacklevel(),
        )


def user_stacklevel() -> int:
    """The `stacklevel` of the first caller outside keras_accel (the user's line), from the
    function that calls `warnings.warn`."""
    import inspect

    package = __name__.split(".")[0]
    frame, level = inspect.currentframe().f_back, 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == package:
        frame, level = frame.f_back, level + 1
    return level
