"""The child process of a benchmark: build, train and measure ONE configuration, then exit.

Run as `python -m keras_accel.benchmark.worker SPEC.json RESULT.json` (the parent,
`keras_accel.benchmark.isolate`, does this). Running each configuration in its own process
is what lets an out-of-memory error become one "OOM" row: the process dies or fails, the
operating system takes all its memory back, and the next configuration starts clean.

The result file holds raw measurements only (epoch times, FLOP counts, memory); the parent
derives seconds per epoch, microseconds per step and MFU from them.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import platform
import resource
import sys
import time
import traceback
from typing import Any

import numpy as np

from keras_accel.benchmark.isolate import OOM, classify_exception, mentions_oom, write_json
from keras_accel.benchmark.spec import BACKEND_MODULES, RunSpec

BERT_CLASSES = 2
BERT_SEQUENCE_LENGTH = 128


class InputProblem(Exception):
    """The data or the model cannot be made: the whole sweep must stop, not record a row."""


def _vm_status() -> dict[str, int]:
    """VmPeak (address space) and VmHWM (resident) of this process, in bytes (Linux)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmPeak", "VmHWM"):
                    found[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return found


def _host_peak_rss() -> int:
    # ru_maxrss is in KiB on Linux (bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# --------------------------------------------------------------------------- data


def _cifar10(spec: RunSpec):
    """Images (N, 32, 32, 3) in [0, 1] and one-hot labels, and where they came from."""
    from keras_accel.data import cifar10

    if spec.synthetic is not True:
        explicit = spec.data is not None or os.environ.get(cifar10.ENV_VAR)
        try:
            data = cifar10.load_cifar10(
                spec.data, num_samples=spec.samples, num_test_samples=0, synthetic=False
            )
            return data.train, data.source, False
        except FileNotFoundError:
            if explicit or spec.synthetic is False:
                raise
    (x, labels), _ = cifar10.synthetic_cifar10(spec.samples, 0, seed=spec.seed)
    y = np.eye(cifar10.NUM_CLASSES, dtype=np.float32)[labels]  # one-hot, as the seed used
    if spec.synthetic:
        source = "synthetic CIFAR-10 stand-in (requested)"
    else:
        looked = ", ".join(cifar10.default_search_dirs())
        source = f"synthetic CIFAR-10 stand-in (no CIFAR-10 found; looked in: {looked})"
    return (x, y), source, True


def _text(spec: RunSpec, model):
    """Synthetic sentences, tokenized once by the model's preprocessor, outside the timing."""
    import keras

    from keras_accel.data.text import synthetic_text_classification

    (texts, labels), _ = synthetic_text_classification(
        spec.samples, 0, num_classes=BERT_CLASSES, seed=spec.seed
    )
    features = model.preprocessor(texts)
    features = {k: keras.ops.convert_to_numpy(v) for k, v in features.items()}
    return (features, labels), "synthetic text classification (keras_accel.data.text)", True


# --------------------------------------------------------------------------- model


def _model_function(reference: str):
    module_name, _, qualname = reference.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise InputProblem(
            f"Cannot import the model function {reference!r} in the benchmark process: "
            f"{type(error).__name__}: {error}"
        ) from None
    return target


def _build_model(spec: RunSpec):
    from keras_accel.models import bert_classifier, cnn, compile_seed, mlp

    if spec.model == "mlp":
        return compile_seed(mlp(width=spec.width))
    if spec.model == "cnn":
        return compile_seed(cnn(width=spec.width))
    if spec.model == "bert":
        model = bert_classifier(num_classes=BERT_CLASSES, sequence_length=BERT_SEQUENCE_LENGTH)
        return model
    model = _model_function(spec.model)()
    if not getattr(model, "compiled", False):
        compile_seed(model)
    return model


# --------------------------------------------------------------------------- measurements


def _epoch_timer():
    import keras

    class EpochTimer(keras.callbacks.Callback):
        """Wall time of every epoch, waiting at the end for the device to finish."""

        def __init__(self):
            super().__init__()
            self.seconds: list[float] = []

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # JAX dispatches asynchronously: without waiting, an epoch would "end" before its
            # last steps ran (and an out-of-memory error would surface later, elsewhere).
            # `iterations` is written by the last step, so reading it waits for all of them.
            keras.ops.convert_to_numpy(self.model.optimizer.iterations)
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def _peak_memory(backend: str, platform_name: str, devices: list[str]) -> tuple[int | None, str]:
    """Peak device memory where the device reports it, else the host's peak resident set."""
    if platform_name in ("gpu", "tpu"):
        try:
            if backend == "jax":
                import jax

                stats = [d.memory_stats() for d in jax.local_devices()]
                peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
                if peaks:
                    return max(peaks), f"device peak ({platform_name})"
            elif backend == "tensorflow" and platform_name == "gpu":
                import tensorflow as tf

                peaks = [
                    tf.config.experimental.get_memory_info(f"GPU:{name.split(':')[-1]}")["peak"]
                    for name in devices
                ]
                return max(peaks), "device peak (gpu)"
        except Exception:  # a device that does not report memory: fall back to the host
            pass
    return _host_peak_rss(), "host peak RSS"


def _device_kind(backend: str, platform_name: str) -> str:
    if platform_name == "cpu":
        return _cpu_name()  # JAX says just "cpu"
    try:
        if backend == "jax":
            import jax

            return jax.devices(platform_name)[0].device_kind
        if backend == "tensorflow" and platform_name == "gpu":
            import tensorflow as tf

            gpu = tf.config.list_physical_devices("GPU")[0]
            return tf.config.experimental.get_device_details(gpu).get("device_name", "GPU")
    except Exception:  # the kind only labels the row, and picks the table entry
        pass
    return platform_name


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _xla_flops(model, batch, mode: str) -> float | None:
    """FLOPs of one train step from XLA's cost analysis (JAX only).

    Keras's own compiled step is hidden inside `fit`, so the same `model.train_step` is
    lowered again from abstract shapes (no memory is allocated). "hlo" analyses the
    program before XLA's optimizations (milliseconds); "compiled" compiles it (seconds),
    which is what runs. For the seed models the two agree to a fraction of a percent.
    """
    import jax

    def abstract(value):
        return jax.ShapeDtypeStruct(value.shape, value.dtype)

    def values(variables):
        return [abstract(v.value) for v in variables]

    state = (
        values(model.trainable_variables),
        values(model.non_trainable_variables),
        values(model.optimizer.variables),
        values(model.metrics_variables),
    )
    data = jax.tree.map(abstract, tuple(batch))
    lowered = jax.jit(model.train_step).lower(state, data)
    analysis = lowered.compile().cost_analysis() if mode == "compiled" else lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one dict per program
        analysis = analysis[0] if analysis else None
    flops = (analysis or {}).get("flops")
    return float(flops) if flops and flops > 0 else None


def _analytic_flops(model, rows: int) -> tuple[float | None, str | None]:
    from keras_accel.models import training_flops

    try:
        return float(training_flops(model, rows)), None
    except ValueError as error:
        return None, str(error)


# --------------------------------------------------------------------------- the run


def run(spec: RunSpec) -> dict[str, Any]:
    """Train one configuration and measure it; returns the raw result record."""
    started = time.perf_counter()
    module = BACKEND_MODULES[spec.backend]
    try:
        backend_module = importlib.import_module(module)
    except ImportError as error:
        return {"status": "not installed", "error": f"{module} cannot be imported: {error}"}
    if spec.devices and spec.devices > 1:
        # Only the CPU platform is split; on a GPU or TPU host this changes nothing there.
        from keras_accel.utils.devices import configure_virtual_cpu_devices

        configure_virtual_cpu_devices(spec.devices)

    import keras

    from keras_accel.adapter.accelerator import Accelerator
    from keras_accel.benchmark.peaks import compute_dtype, measure_matmul_flops, peak_flops
    from keras_accel.data.batching import static_batch_size
    from keras_accel.data.cifar10 import CifarFormatError

    acc = Accelerator(
        strategy=spec.strategy,
        devices=spec.devices,
        mixed_precision=spec.mixed_precision,
        seed=spec.seed,
    )
    try:
        with acc.scope():
            model = _build_model(spec)
        if spec.model == "bert":
            (x, y), source, synthetic = _text(spec, model)
            with acc.scope():
                from keras_accel.models import compile_seed

                # Tokenized above, once: time the model, not the tokenizer. A plain functional
                # model over the same layers, because keras-hub's `fit` insists on running
                # its preprocessor through tf.data.
                model = compile_seed(keras.Model(model.inputs, model.outputs), "bert")
        else:
            (x, y), source, synthetic = _cifar10(spec)
    except (CifarFormatError, FileNotFoundError, InputProblem) as error:
        raise InputProblem(str(error)) from None
    except ValueError as error:
        # The loader's "asked for more samples than the data holds", a model argument...
        raise InputProblem(f"{type(error).__name__}: {error}") from None
    setup_seconds = time.perf_counter() - started

    timer = _epoch_timer()
    acc.fit(
        model, x, y, batch_size=spec.batch_size, epochs=spec.epochs, verbose=0, callbacks=[timer]
    )
    fit_seconds = time.perf_counter() - started - setup_seconds

    platform_name = acc.devices[0].split(":")[0]
    rows = static_batch_size(spec.batch_size, acc.num_replicas)
    record: dict[str, Any] = {
        "status": "ok",
        "epoch_seconds": timer.seconds,
        "steps_per_epoch": math.ceil(spec.samples / spec.batch_size),
        "static_batch": rows,
        "num_recompiles": acc.num_recompiles,
        "strategy": acc.strategy_name,
        "num_replicas": acc.num_replicas,
        "devices": acc.devices,
        "platform": platform_name,
        "device_kind": _device_kind(spec.backend, platform_name),
        "data_source": source,
        "synthetic": synthetic,
        "versions": {
            "keras": keras.__version__,
            spec.backend: getattr(backend_module, "__version__", "?"),
            "python": platform.python_version(),
        },
        "setup_seconds": setup_seconds,
        "fit_seconds": fit_seconds,
    }
    memory, memory_kind = _peak_memory(spec.backend, platform_name, acc.devices)
    record.update(memory_peak_bytes=memory, memory_kind=memory_kind)

    flops, why_not = _analytic_flops(model, rows)
    record.update(flops_analytic=flops, flops_analytic_note=why_not)
    record.update(flops_xla=None, flops_xla_source=None)
    if spec.backend == "jax" and spec.flops_from in ("compiled", "hlo"):
        batch = acc.dataset(x, y, batch_size=spec.batch_size)[0]
        record["flops_xla"] = _xla_flops(model, batch, spec.flops_from)
        record["flops_xla_source"] = f"XLA cost analysis ({spec.flops_from})"

    dtype = compute_dtype(spec.mixed_precision)
    record["compute_dtype"] = dtype
    count = len(acc.devices)
    if spec.peak_tflops:
        record["peak_flops"] = spec.peak_tflops * 1e12 * count
        record["peak_source"] = f"given: {spec.peak_tflops:g} TFLOP/s x {count} device(s)"
    elif platform_name == "cpu":
        if spec.measure_peak:
            # Virtual CPU devices share the same cores: the host's matmul rate is the peak.
            try:
                with acc.scope():
                    measured = measure_matmul_flops(dtype, repeats=5)
                record["peak_flops"] = measured
                record["peak_source"] = (
                    f"measured: 2048x2048 {dtype} matmul on this host ({spec.backend})"
                )
            except Exception as error:  # the row's timings stand without an MFU
                record["peak_flops"] = None
                record["peak_source"] = f"matmul measurement failed: {error}"[:300]
        else:
            record.update(peak_flops=None, peak_source="not measured")
    else:
        found = peak_flops(platform_name, record["device_kind"], dtype)
        if found:
            record["peak_flops"] = found[0] * count
            record["peak_source"] = f"{found[1]} x {count} device(s)"
        else:
            record["peak_flops"] = None
            record["peak_source"] = (
                f"unknown device kind {record['device_kind']!r}: pass --peak-tflops"
            )
    record.update(_vm_status())
    record["wall_seconds"] = time.perf_counter() - started
    return record


def _describe_error(error: BaseException) -> tuple[str, str]:
    """One telling line (the memory message if there is one), and the head of the text.

    TensorFlow's errors put the node's Python stack before the cause, so neither the first
    nor the last line alone says what happened.
    """
    name = type(error).__name__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    key = next((line for line in lines if mentions_oom(line)), lines[0] if lines else "")
    return f"{name}: {key}"[:500], f"{name}: {error}"[:4000]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(
            "usage: python -m keras_accel.benchmark.worker SPEC.json RESULT.json", file=sys.stderr
        )
        return 2
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = RunSpec.from_dict(json.load(f))
    try:
        record = run(spec)
    except InputProblem as error:
        record = {"status": "input error", "error": str(error)}
    except BaseException as error:  # every failure becomes a row; OOM is the expected one
        status = classify_exception(error)
        summary, detail = _describe_error(error)
        if status != OOM:
            traceback.print_exc()
        del error  # let go of what the failed step held
        record = {"status": status, "error": summary, "error_detail": detail}
    write_json(result_path, record)
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
