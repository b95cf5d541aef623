"""Run one configuration in a child process and say how it ended: ok, OOM, error, timeout.

An out-of-memory error inside a process that goes on running leaves the allocator fragmented
and, on GPUs, memory held by the framework; the next configuration would be measured on a
damaged process, or crash too. A child process per configuration avoids both: whatever
happens, the operating system takes the memory back when it exits.

The parent imports nothing beyond what `import keras_accel` does and never touches a device
(a JAX parent that did would pre-allocate most of the GPU's memory and starve its children).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

OK = "ok"
OOM = "OOM"
ERROR = "error"
TIMEOUT = "timeout"
NOT_INSTALLED = "not installed"
INPUT_ERROR = "input error"
STATUSES = (OK, OOM, ERROR, TIMEOUT, NOT_INSTALLED, INPUT_ERROR)

# How the frameworks and the C++ runtime word running out of memory (matched lower case):
# XLA "RESOURCE_EXHAUSTED: Out of memory while trying to allocate", XLA:CPU "Out of memory
# allocating N bytes", TensorFlow's "OOM when allocating tensor" and BFC allocator "ran out of
# memory", C++ `std::bad_alloc`, Python's MemoryError, errno ENOMEM.
OOM_PATTERNS = (
    "out of memory",
    "resource_exhausted",
    "resource exhausted",
    "resourceexhaustederror",
    "oom when allocating",
    "ran out of memory",
    "bad_alloc",
    "memoryerror",
    "cannot allocate memory",
    "failed to allocate",
)
# XNNPACK/YNNPACK (XLA:CPU kernels) log "allocate of <5> failed." and then raise a bare
# "INTERNAL: YNNPACK operation failed"; other runtimes say "allocation ... failed".
_OOM_REGEX = re.compile(r"\balloc\w*\b[^\n]{0,80}\bfailed\b")

# Started with `python -c`, so the limit is set before anything is imported: with a
# `preexec_fn` the fork would run Python code in a child of a possibly threaded parent.
_BOOTSTRAP = """\
import resource, runpy, sys
limit = int(sys.argv[1])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
sys.argv = ["keras_accel.benchmark.worker"] + sys.argv[2:]
runpy.run_module("keras_accel.benchmark.worker", run_name="__main__", alter_sys=True)
"""

_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")


def mentions_oom(text: str) -> bool:
    """Whether an error text says that memory ran out.

    Example:
        >>> mentions_oom("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8 GiB")
        True
        >>> mentions_oom("allocate of <5> failed.")
        True
        >>> mentions_oom("ValueError: shapes (3,) and (4,) do not match")
        False
    """
    lowered = text.lower()
    return any(p in lowered for p in OOM_PATTERNS) or bool(_OOM_REGEX.search(lowered))


def classify_exception(error: BaseException) -> str:
    """OOM for `MemoryError` or an error whose type or message says memory ran out."""
    if isinstance(error, MemoryError):
        return OOM
    return OOM if mentions_oom(f"{type(error).__name__}: {error}") else ERROR


def classify_exit(
    returncode: int, stderr_tail: str, memory_limit_mb: int | None = None
) -> tuple[str, str]:
    """Status and reason for a child that died without writing its result.

    Example:
        >>> classify_exit(-9, "")[0]
        'OOM'
        >>> classify_exit(-11, "Allocator (mklcpu) ran out of memory trying to allocate")[0]
        'OOM'
        >>> classify_exit(1, "ZeroDivisionError: division by zero")
        ('error', 'exit code 1: ZeroDivisionError: division by zero')
    """
    how = f"exit code {returncode}"
    if returncode < 0:
        try:
            how = f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"killed by signal {-returncode}"
    last = _last_error_line(stderr_tail)
    if mentions_oom(stderr_tail):
        return OOM, f"{how}: {last}" if last else how
    if returncode == -signal.SIGKILL:
        # Nobody here sent it (a timeout is reported as such): the kernel's OOM killer.
        return OOM, f"{how}, most likely by the kernel's out-of-memory killer"
    if memory_limit_mb and returncode in _CRASH_SIGNALS:
        # Native code that does not check an allocation (thread stacks, some allocators)
        # crashes instead of reporting when the address-space limit is reached.
        return OOM, f"{how} under the {memory_limit_mb} MiB address-space limit"
    missing = re.search(r"No module named '(jax|tensorflow|torch)'", stderr_tail)
    if missing:
        return NOT_INSTALLED, f"{missing.group(1)} cannot be imported"
    return ERROR, f"{how}: {last}" if last else how


_CRASH_SIGNALS = {-signal.SIGSEGV, -signal.SIGABRT, -signal.SIGBUS}
# absl log lines: "I0000 00:00:17...", "W0000 ...", "E0000 ...".
_LOG_LINE = re.compile(r"^[IWEF]\d{4} ")


def _last_error_line(text: str) -> str:
    """The most telling line of a child's stderr: a memory message, else an exception."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if mentions_oom(line):
            return line[:500]
    for line in reversed(lines):
        if not _LOG_LINE.match(line) and re.match(r"^[\w.]*(Error|Exception|Exit)\b", line):
            return line[:500]
    for line in reversed(lines):
        if line.startswith(("F0", "E0")) or "Check failed" in line or "Fatal" in line:
            return line[:500]
    return lines[-1][:500] if lines else ""


def write_json(path: str, record: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file from a child killed mid-write."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def child_env(backend: str, extra_paths: list[str] | None = None) -> dict[str, str]:
    """The parent's environment, with the child's backend and one CPU device by default."""
    env = dict(os.environ)
    env["KERAS_BACKEND"] = backend
    # The child's stderr goes to a file that only failures are read from, and TensorFlow's
    # allocator says "ran out of memory" at warning level: keep warnings.
    env["TF_CPP_MIN_LOG_LEVEL"] = "1"
    # One CPU device unless the spec asks for more: drop any inherited device-count setting.
    env.pop("JAX_NUM_CPU_DEVICES", None)
    if "XLA_FLAGS" in env:
        flags = _DEVICE_COUNT_FLAG.sub("", env["XLA_FLAGS"]).strip()
        if flags:
            env["XLA_FLAGS"] = flags
        else:
            del env["XLA_FLAGS"]
    # The child must import the same keras_accel (and model module) as this process.
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # keras_accel/
    root = os.path.dirname(package)
    paths = [root, *(extra_paths or []), *env.get("PYTHONPATH", "").split(os.pathsep)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    return env


def _tail(path: str, limit: int = 20000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_isolated(
    spec: dict[str, Any],
    *,
    timeout_s: float | None = None,
    memory_limit_mb: int | None = None,
    extra_paths: list[str] | None = None,
) -> dict[str, Any]:
    """Run `keras_accel.benchmark.worker` on `spec` in a new process and return its record.

    Args:
        spec: a `RunSpec` as a dict.
        timeout_s: kill the child (and its process group) after this many seconds.
        memory_limit_mb: address-space limit (RLIMIT_AS) of the child, in MiB.
        extra_paths: added to the child's PYTHONPATH (where a model function lives).

    Returns:
        The child's record (see the worker) with at least `status`, plus `error` when it
        failed, `stderr_tail` when it died without a record, and `wall_seconds`.
    """
    limit = int(memory_limit_mb * 2**20) if memory_limit_mb else 0
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="keras_accel_bench_") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        result_path = os.path.join(tmp, "result.json")
        stderr_path = os.path.join(tmp, "stderr.txt")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        command = [sys.executable, "-c", _BOOTSTRAP, str(limit), spec_path, result_path]
        timed_out = False
        env = child_env(spec["backend"], extra_paths)
        if limit:
            # glibc reserves 64 MiB of address space per thread arena; under an address-space
            # limit those reservations, not real use, would decide when memory "runs out".
            env.setdefault("MALLOC_ARENA_MAX", "2")
        with open(os.devnull, "wb") as out, open(stderr_path, "wb") as err:
            # A new session makes the child the leader of its own process group, so a
            # timeout can end it and anything it started, and nothing else.
            process = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
            try:
                returncode = process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(process)
                returncode = process.wait()
            except BaseException:  # Ctrl-C in the parent: do not leave the child running
                _kill_group(process)
                process.wait()
                raise
        record: dict[str, Any] | None = None
        if os.path.exists(result_path):
            with open(result_path) as f:
                record = json.load(f)
        stderr_tail = _tail(stderr_path)
    wall = time.perf_counter() - started
    if timed_out:
        record = {"status": TIMEOUT, "error": f"no result after {timeout_s:g} s; killed"}
    elif record is None:
        status, reason = classify_exit(returncode, stderr_tail, memory_limit_mb)
        record = {"status": status, "error": reason, "stderr_tail": stderr_tail[-4000:]}
    elif record.get("status") == ERROR:
        record["stderr_tail"] = stderr_tail[-4000:]
        if mentions_oom(record["stderr_tail"]):
            # The exception said little, but the runtime logged the allocation failure.
            record["status"] = OOM
    record.setdefault("wall_seconds", wall)
    record["process_seconds"] = wall
    return record


def _kill_group(process: subprocess.Popen) -> None:
    # Already gone, or (PermissionError) reaped and its id reused by someone else's process.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
