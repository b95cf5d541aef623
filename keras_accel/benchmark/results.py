"""Benchmark results: one `BenchResult` per (backend, batch size), a `BenchReport` per sweep,
and their Markdown, JSON, CSV and PNG forms.

A child process records raw measurements (epoch wall times, FLOP counts, memory); every
derived figure (steady seconds per epoch, microseconds per step, samples/s, compile time,
MFU) is computed here, by pure functions, so one definition serves every output.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from typing import Any

from keras_accel.benchmark.isolate import NOT_INSTALLED, OK, OOM
from keras_accel.state import files, outputs

_RAW_FIELDS = (
    "epoch_seconds", "steps_per_epoch", "static_batch", "num_recompiles", "strategy",
    "num_replicas", "devices", "platform", "device_kind", "data_source", "synthetic",
    "versions", "memory_peak_bytes", "memory_kind", "flops_analytic", "flops_analytic_note",
    "flops_xla", "flops_xla_source", "compute_dtype", "peak_flops", "peak_source", "error",
    "error_detail", "stderr_tail", "wall_seconds",
)  # fmt: skip


@dataclasses.dataclass
class BenchResult:
    """One configuration's outcome: what was asked, what happened, what was measured.

    `status` is "ok", "OOM", "error", "timeout" or "not installed". Every measurement is None
    when it could not be taken (failed run, single epoch, device without a FLOP table entry).

    Example:
        >>> r = BenchResult("jax", "mlp", 256, OK, samples=1024, epochs=3,
        ...                 epoch_seconds=[9.0, 2.0, 1.0], steps_per_epoch=4, static_batch=256,
        ...                 flops_analytic=4e9, peak_flops=1e11)
        >>> r.steady_epoch_seconds, r.compile_seconds, r.us_per_step, r.samples_per_second
        (1.0, 8.0, 250000.0, 1024.0)
        >>> round(r.mfu, 3)  # 4 GFLOP x 4 steps in 1 s, on a 100 GFLOP/s peak
        0.16
    """

    backend: str
    model: str
    batch_size: int
    status: str
    samples: int = 0
    epochs: int = 0
    mixed_precision: str | None = None
    epoch_seconds: list[float] = dataclasses.field(default_factory=list)
    steps_per_epoch: int | None = None
    static_batch: int | None = None
    num_recompiles: int | None = None
    strategy: str | None = None
    num_replicas: int | None = None
    devices: list[str] = dataclasses.field(default_factory=list)
    platform: str | None = None
    device_kind: str | None = None
    data_source: str | None = None
    synthetic: bool | None = None
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    memory_peak_bytes: int | None = None
    memory_kind: str | None = None
    flops_analytic: float | None = None
    flops_analytic_note: str | None = None
    flops_xla: float | None = None
    flops_xla_source: str | None = None
    compute_dtype: str | None = None
    peak_flops: float | None = None
    peak_source: str | None = None
    error: str | None = None
    error_detail: str | None = None
    stderr_tail: str | None = None
    wall_seconds: float | None = None

    @classmethod
    def from_record(cls, spec: dict[str, Any], record: dict[str, Any]) -> BenchResult:
        """Combine a `RunSpec` dict and the record of the child that ran it."""
        raw = {key: record[key] for key in _RAW_FIELDS if record.get(key) is not None}
        return cls(
            backend=spec["backend"],
            model=spec["model"],
            batch_size=spec["batch_size"],
            status=record.get("status", "error"),
            samples=spec["samples"],
            epochs=spec["epochs"],
            mixed_precision=spec.get("mixed_precision"),
            **raw,
        )

    # ------------------------------------------------------------------ derived figures
    @property
    def first_epoch_seconds(self) -> float | None:
        """The first epoch, compilation included (what the seed complained about)."""
        return self.epoch_seconds[0] if self.epoch_seconds else None

    @property
    def steady_epoch_seconds(self) -> float | None:
        """Best epoch after the first, as the seed reported (None with a single epoch)."""
        return min(self.epoch_seconds[1:]) if len(self.epoch_seconds) > 1 else None

    @property
    def compile_seconds(self) -> float | None:
        """First epoch minus the steady epoch: compilation and warm-up."""
        first, steady = self.first_epoch_seconds, self.steady_epoch_seconds
        return None if first is None or steady is None else max(first - steady, 0.0)

    @property
    def us_per_step(self) -> float | None:
        steady = self.steady_epoch_seconds
        if steady is None or not self.steps_per_epoch:
            return None
        return steady / self.steps_per_epoch * 1e6

    @property
    def samples_per_second(self) -> float | None:
        steady = self.steady_epoch_seconds
        return None if not steady else self.samples / steady

    @property
    def flops_per_step(self) -> float | None:
        """FLOPs of one step on `static_batch` rows: XLA's count where there is one."""
        return self.flops_xla if self.flops_xla else self.flops_analytic

    @property
    def flops_source(self) -> str | None:
        if self.flops_xla:
            return self.flops_xla_source or "XLA cost analysis"
        return "analytic (Dense/Conv)" if self.flops_analytic else None

    @property
    def achieved_flops(self) -> float | None:
        """Useful FLOP/s of the steady epoch: padding rows of the last batch do not count."""
        per_step, sps = self.flops_per_step, self.samples_per_second
        if not per_step or not sps or not self.static_batch:
            return None
        return per_step / self.static_batch * sps

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: achieved FLOP/s over the peak of the devices used."""
        achieved = self.achieved_flops
        return None if achieved is None or not self.peak_flops else achieved / self.peak_flops

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        for name in DERIVED:
            values[name] = getattr(self, name)
        return values


DERIVED = (
    "first_epoch_seconds", "steady_epoch_seconds", "compile_seconds", "us_per_step",
    "samples_per_second", "flops_per_step", "flops_source", "achieved_flops", "mfu",
)  # fmt: skip


def share_across_rows(results: list[BenchResult]) -> None:
    """Make the rows of one sweep use one CPU peak and one FLOP count per step shape."""
    _share_measured_peaks(results)
    _share_xla_flops(results)


def _share_measured_peaks(results: list[BenchResult]) -> None:
    """Give every CPU row the best matmul rate measured in the sweep, on any backend.

    The CPU's peak is a property of the host, not of a run or a backend: each child measures
    it in a second or so, and a busy host (another process on the same cores) can halve one
    measurement, while one backend's matmul kernel may be slower than another's. The best
    rate seen is the closest to the hardware's peak, and one denominator keeps the MFU of
    every row and every backend comparable.
    """
    best: dict[tuple, BenchResult] = {}
    measured = [r for r in results if r.peak_flops and (r.peak_source or "").startswith("meas")]
    for r in measured:
        key = (r.device_kind, r.compute_dtype)
        if key not in best or r.peak_flops > best[key].peak_flops:
            best[key] = r
    for r in measured:
        top = best[(r.device_kind, r.compute_dtype)]
        r.peak_flops = top.peak_flops
        r.peak_source = (
            f"measured: 2048x2048 {r.compute_dtype} matmul on this host, the best of the "
            f"sweep's runs ({top.backend}, batch {top.batch_size} run)"
        )


def _share_xla_flops(results: list[BenchResult]) -> None:
    """Rows without an XLA count (TensorFlow) take the JAX row's count of the same step.

    The training step is the same Keras computation on every backend, so its FLOPs are too;
    using one count for all backends keeps their MFU comparable (the analytic count, also
    shown, is about 1.3x XLA's for the seed models: see the notes).
    """
    counted = {
        (r.model, r.static_batch, r.compute_dtype): r
        for r in results
        if r.flops_xla and not (r.flops_xla_source or "").endswith("run)")
    }
    for r in results:
        source = counted.get((r.model, r.static_batch, r.compute_dtype))
        if not r.flops_xla and source is not None and r.status == OK:
            r.flops_xla = source.flops_xla
            label = source.flops_xla_source or "XLA cost analysis ()"
            r.flops_xla_source = f"{label.rstrip(')')}, from the {source.backend} run)"


# --------------------------------------------------------------------------- formatting


def _seconds(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:#.3g}" if value < 10 else f"{value:.1f}"


def _number(value: float | None, digits: int = 0) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _giga(value: float | None) -> str:
    return "n/a" if not value else f"{value / 1e9:,.3g}"


def _memory(value: int | None) -> str:
    return "n/a" if not value else f"{value / 2**30:.2f} GiB"


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def cell(result: BenchResult | None, figure: str) -> str:
    """One table cell: the figure, or the reason there is none ("OOM", "not installed")."""
    if result is None:
        return ""
    if result.status != OK:
        return result.status
    if figure == "steady":
        value = result.steady_epoch_seconds
        return _seconds(value) if value is not None else f"({_seconds(result.first_epoch_seconds)})"
    if figure == "us_per_step":
        return _number(result.us_per_step)
    raise ValueError(f"Unknown figure {figure!r}")


@dataclasses.dataclass
class BenchReport:
    """A sweep: the settings, and one `BenchResult` per backend and batch size.

    Example:
        >>> report = BenchReport({"model": "mlp", "samples": 512, "epochs": 2}, [
        ...     BenchResult("jax", "mlp", 256, OK, 512, 2, epoch_seconds=[3.0, 1.0],
        ...                 steps_per_epoch=2, static_batch=256),
        ...     BenchResult("tensorflow", "mlp", 256, OOM, 512, 2)])
        >>> print(report.seed_table())
        | batch | jax s/epoch | tensorflow s/epoch | jax µs/step | tensorflow µs/step |
        |---:|---:|---:|---:|---:|
        | 256 | 1.00 | OOM | 500,000 | OOM |
    """

    config: dict[str, Any]
    results: list[BenchResult]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def backends(self) -> list[str]:
        return list(dict.fromkeys(r.backend for r in self.results))

    @property
    def batch_sizes(self) -> list[int]:
        return list(dict.fromkeys(r.batch_size for r in self.results))

    def get(self, backend: str, batch_size: int) -> BenchResult | None:
        for result in self.results:
            if result.backend == backend and result.batch_size == batch_size:
                return result
        return None

    def seed_table(self) -> str:
        """Seconds per epoch and microseconds per step by batch size, one column per backend,
        shaped like the seed's TPU-vs-GPU table."""
        backends = self.backends
        head = ["batch"] + [f"{b} s/epoch" for b in backends]
        head += [f"{b} µs/step" for b in backends]
        rows = [_row(head), "|" + "---:|" * len(head)]
        for batch in self.batch_sizes:
            cells = [str(batch)]
            cells += [cell(self.get(b, batch), "steady") for b in backends]
            cells += [cell(self.get(b, batch), "us_per_step") for b in backends]
            rows.append(_row(cells))
        return "\n".join(rows)

    def detail_table(self, backend: str) -> str:
        """Every figure of one backend, by batch size."""
        head = [
            "batch",
            "status",
            "1st epoch s",
            "s/epoch",
            "compile s",
            "µs/step",
            "samples/s",
            "peak memory",
            "GFLOP/step XLA",
            "GFLOP/step analytic",
            "peak TFLOP/s",
            "MFU",
            "recompiles",
        ]
        rows = [_row(head), "|" + "---:|" * len(head)]
        for batch in self.batch_sizes:
            r = self.get(backend, batch)
            if r is None:
                continue
            rows.append(
                _row(
                    [
                        str(batch),
                        r.status,
                        _seconds(r.first_epoch_seconds),
                        _seconds(r.steady_epoch_seconds),
                        _seconds(r.compile_seconds),
                        _number(r.us_per_step),
                        _number(r.samples_per_second),
                        _memory(r.memory_peak_bytes),
                        _giga(r.flops_xla),
                        _giga(r.flops_analytic),
                        _number(r.peak_flops / 1e12 if r.peak_flops else None, 2),
                        _percent(r.mfu),
                        "n/a" if r.num_recompiles is None else str(r.num_recompiles),
                    ]
                )
            )
        return "\n".join(rows)

    def to_markdown(self) -> str:
        """The whole report: settings, the seed-shaped table, then one detail table per
        backend with the notes a reader needs to check the figures."""
        c = self.config
        precision = c.get("mixed_precision") or "float32"
        lines = [
            f"## keras-accel bench: {c.get('model')} (width {c.get('width', 1.0):g}), "
            f"{c.get('samples')} samples, {c.get('epochs')} epochs, {precision}",
            "",
        ]
        sources = {r.data_source for r in self.results if r.data_source}
        for source in sorted(sources):
            lines.append(f"Data: {source}.")
        load, cpus = self.meta.get("load_average"), self.meta.get("cpu_count")
        if load is not None:
            lines.append(f"Host: {cpus} CPU cores, load average {load:.2f} when the sweep began.")
        steady = (
            "best epoch after the first"
            if (c.get("epochs") or 0) > 1
            else "one epoch only: no steady state, the first epoch is shown in parentheses"
        )
        lines += ["", f"Seconds per epoch ({steady}) and microseconds per step:", ""]
        lines += [self.seed_table(), ""]
        for backend in self.backends:
            ran = [r for r in self.results if r.backend == backend]
            lines += [f"### {backend}: {_describe(ran)}", ""]
            if any(r.status != NOT_INSTALLED for r in ran):
                lines += [self.detail_table(backend), ""]
            lines += [f"- {note}" for note in _notes(ran)]
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"

    def to_json(self, path: str) -> None:
        """Write the report as JSON to `path`: a local path or a URL (`gs://`, `s3://`, any
        fsspec protocol), written whole."""
        outputs.write(path, json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_json(cls, path: str) -> BenchReport:
        """Read a report written by `to_json` (a local path or a URL), e.g. on another
        machine, to print or merge it.

        Example:
            >>> import os, tempfile
            >>> path = os.path.join(tempfile.mkdtemp(), "bench.json")
            >>> BenchReport({"model": "mlp"}, [BenchResult("jax", "mlp", 64, OOM)]).to_json(path)
            >>> BenchReport.from_json(path).results[0].status
            'OOM'
        """
        data = json.loads(files.read_text(path))
        names = {field.name for field in dataclasses.fields(BenchResult)}
        results = [
            BenchResult(**{k: v for k, v in row.items() if k in names}) for row in data["results"]
        ]
        return cls(data.get("config", {}), results, data.get("meta", {}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config,
            "meta": self.meta,
            "results": [r.to_dict() for r in self.results],
        }

    def to_csv(self, path: str) -> None:
        """One row per (backend, batch size), to `path` (local or URL); lists and dicts are
        written as JSON."""
        rows = [r.to_dict() for r in self.results]
        fields = list(rows[0]) if rows else ["backend", "batch_size", "status"]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in row.items()}
            )
        outputs.write(path, text.getvalue())

    def plot(self, path: str) -> None:
        """A PNG of steady seconds per epoch and MFU against batch size, one line per backend,
        to `path` (local or URL; `.svg`/`.pdf` names get that format).

        Raises:
            ImportError: matplotlib is not installed (`pip install keras-accel[plot]`).
        """
        plt = import_pyplot()
        figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        for backend in self.backends:
            ok = [r for r in self.results if r.backend == backend and r.status == OK]
            timed = [r for r in ok if r.steady_epoch_seconds is not None]
            if timed:
                left.plot(
                    [r.batch_size for r in timed],
                    [r.steady_epoch_seconds for r in timed],
                    marker="o",
                    label=backend,
                )
            used = [r for r in ok if r.mfu is not None]
            if used:
                right.plot(
                    [r.batch_size for r in used],
                    [100 * r.mfu for r in used],
                    marker="o",
                    label=backend,
                )
            for r in self.results:
                if r.backend == backend and r.status == OOM:
                    left.axvline(r.batch_size, color="grey", linestyle=":", linewidth=1)
        c = self.config
        left.set(
            xscale="log",
            yscale="log",
            xlabel="batch size",
            ylabel="s/epoch (steady)",
            title=f"{c.get('model')}: seconds per epoch (dotted: OOM)",
        )
        right.set(
            xscale="log",
            xlabel="batch size",
            ylabel="MFU (%)",
            title=f"{c.get('model')}: model FLOPs utilisation",
        )
        sizes = sorted({r.batch_size for r in self.results})
        for axis in (left, right):
            # Ticks at the batch sizes measured, written out (not 2x10^2).
            axis.set_xticks(sizes, [str(size) for size in sizes])
            axis.set_xticks([], minor=True)
            axis.grid(True, which="both", alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend()
        figure.tight_layout()
        try:
            outputs.write_figure(path, figure, dpi=110)
        finally:
            plt.close(figure)


def import_pyplot():
    """matplotlib's pyplot on a file-only backend, or an ImportError saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "--plot needs matplotlib, the optional `plot` extra: pip install "
            f"keras-accel[plot] (or pip install matplotlib). Received: {error}"
        ) from None
    return plt


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _describe(results: list[BenchResult]) -> str:
    ran = next((r for r in results if r.devices), None)
    if ran is None:
        reasons = sorted({r.status for r in results})
        return ", ".join(reasons)
    versions = ", ".join(f"{k} {v}" for k, v in ran.versions.items())
    return (
        f"{len(ran.devices)} x {ran.platform} ({ran.device_kind}), strategy {ran.strategy}, "
        f"{ran.num_replicas} replica(s), {ran.compute_dtype}; {versions}"
    )


def _notes(results: list[BenchResult]) -> list[str]:
    notes = []
    ok = [r for r in results if r.status == OK]
    sources = sorted({r.peak_source for r in ok if r.peak_source})
    if sources:
        notes.append("Peak FLOP/s: " + "; ".join(sources) + ".")
    xla = next((r for r in ok if r.flops_xla and r.flops_analytic), None)
    if xla:
        ratio = xla.flops_xla / xla.flops_analytic
        if 0.5 <= ratio <= 1.5:
            why = (
                "XLA does not compute the first layer's input gradient (nothing needs it), "
                "which the analytic 3x counts, and it adds BatchNorm/optimizer element-wise "
                "FLOPs."
            )
        else:
            why = (
                "The analytic count sees only Dense/Conv layers listed in the model (not those "
                "inside composite layers such as transformer blocks): a lower bound here."
            )
        notes.append(
            f"FLOPs per step: {xla.flops_xla_source} (used for MFU) vs analytic 3 x forward "
            f"Dense/Conv: {ratio:.2f} x at batch {xla.batch_size}. {why}"
        )
    elif any(r.flops_analytic for r in ok):
        notes.append(
            "FLOPs per step: analytic (3 x forward FLOPs of Dense/Conv layers); this backend "
            "gives no XLA cost analysis."
        )
    memory = sorted({r.memory_kind for r in ok if r.memory_kind})
    if memory:
        notes.append("Peak memory: " + ", ".join(memory) + ".")
    if any(r.num_recompiles for r in ok):
        notes.append("Recompiles after the first epoch: see the recompiles column.")
    for r in results:
        if r.status not in (OK, NOT_INSTALLED) and r.error:
            notes.append(f"batch {r.batch_size}: {r.status}: {' '.join(r.error.split())[:300]}")
        elif r.status == NOT_INSTALLED:
            notes.append(f"{r.backend} is not installed here: its rows were not run.")
            break
    return notes
