"""`keras-accel launch`: N processes of one script on this host, as a cluster would start them.

Each process gets the environment a multi-host job gets from its cluster manager, pointed at
127.0.0.1: Keras's `KERAS_DISTRIBUTION_*` variables (JAX's distributed runtime, with CPU
collectives when there is no accelerator), `TF_CONFIG` (TensorFlow's multi-worker
strategies) and torchrun's `WORLD_SIZE`/`RANK`/`LOCAL_RANK`/`MASTER_ADDR`/`MASTER_PORT`
(`torch.distributed`), so the same script, unchanged, runs here and on a pod. Their output is
streamed line by line, prefixed with the process index. The launch ends with the first failure: the
other processes get SIGTERM, then SIGKILL after `--grace` seconds, and the message names the
process whose error came first and how (not a peer that its end broke); a process found stopped
(SIGSTOP, job control: it answers no collective) is named as the one that stopped answering,
when its peers fail on it or after `--stall-timeout` seconds. SIGTERM or Ctrl-C to
the launcher is passed on to every process (a preemption:
`keras_accel.callbacks.BackupAndRestore` saves, then the process exits).

Before any process starts, a Keras backend that is chosen but not installed is one error. Unless
the user set them, processes get `TF_CPP_MIN_LOG_LEVEL=2` and, on torch, `OMP_NUM_THREADS=1`
(as torchrun); start-up lines that cannot be quieted where they start (TensorFlow's before
absl's log is set up, jaxlib's Gloo connections) are left out (`OutputFilter`).

Example:
    keras-accel launch -n 2 --devices-per-process 4 train.py --epochs 3
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

DEFAULT_GRACE_S = 30.0
# How long a process may stay stopped (SIGSTOP, job control) before the launch names it and
# ends: longer than a debugger's look, shorter than the collectives' own timeouts (the
# others otherwise fail after 42-138 s, each naming itself).
DEFAULT_STALL_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n", "--num-processes", type=int, required=True, metavar="N", help="processes to start"
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="K",
        help="split each process's CPU into K devices (JAX only: ignored, with a note, on "
        "TensorFlow, whose workers use one CPU device each)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="the coordinator's port on 127.0.0.1 (default: a free one)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help=f"after SIGTERM, how long processes get before SIGKILL (default {DEFAULT_GRACE_S:g})",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_S,
        metavar="SECONDS",
        help="how long a process may stay stopped (SIGSTOP, job control) before the launch "
        f"names it and ends; 0: never (default {DEFAULT_STALL_S:g})",
    )
    parser.add_argument("script", help="the Python script to run in every process")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now (the OS picks them)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def process_env(index: int, ports: list[int], devices_per_process: int | None) -> dict[str, str]:
    """The variables that make process `index` one of `len(ports)` on this host."""
    addresses = [f"127.0.0.1:{port}" for port in ports]
    env = {
        # JAX (through keras.distribution / jax.distributed): the first address coordinates.
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": addresses[0],
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(ports)),
        "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
        # TensorFlow's multi-worker strategies: one worker per process, worker 0 the chief.
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        ),
        # torch.distributed (torchrun's variables): rank 0's host and port hold the store.
        "WORLD_SIZE": str(len(ports)),
        "RANK": str(index),
        "LOCAL_RANK": str(index),
        "LOCAL_WORLD_SIZE": str(len(ports)),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(ports[0]),
        "PYTHONUNBUFFERED": "1",
    }
    if devices_per_process is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    return env


# Keras backend -> the package it imports as Keras loads (and keras-accel's extra of that name).
BACKEND_PACKAGES = {"jax": "jax", "tensorflow": "tensorflow", "torch": "torch"}


def is_installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # A finder that refuses it, a broken installation.
        return False


def missing_backend_error() -> str | None:
    """Why every process would stop at `import keras`, said once, before any starts: the
    backend chosen (KERAS_BACKEND or keras.json) is not installed here. None where it is, or
    where nothing chose one (a launched script need not use Keras)."""
    from keras_accel.cli.backend import configured_backend

    backend, source = configured_backend()
    package = BACKEND_PACKAGES.get(backend)
    if package is None or source == "Keras's default" or is_installed(package):
        return None
    installed = [
        name for name, p in BACKEND_PACKAGES.items() if name != backend and is_installed(p)
    ]
    instead = f", or set KERAS_BACKEND to one that is ({', '.join(installed)})" if installed else ""
    return (
        f"the Keras backend {backend!r} ({source}) needs {package}, which is not installed for "
        f"{sys.executable}: every process would fail at `import keras`. Install it with "
        f'`pip install -c constraints.txt -e ".[{backend}]"` from the keras-accel checkout '
        f"(the {backend!r} extra){instead}."
    )


def child_defaults(
    backend: str, num_processes: int, environ: dict[str, str]
) -> tuple[dict[str, str], list[str]]:
    """Variables every process gets unless the user set them, and a note for each that
    changes what the user would otherwise get.

    - `TF_CPP_MIN_LOG_LEVEL=2`: TensorFlow's C++ info and warning lines, once per process
      (TensorFlow is imported under every backend: keras-hub and tf.data bring it).
    - `OMP_NUM_THREADS=1` on torch with several processes, as torchrun sets it: each torch
      process otherwise starts one OpenMP thread per core, N processes oversubscribe the
      cores, and a launch ran ~2.5x slower than torchrun's. JAX (XLA) and TensorFlow size
      their own thread pools and do not read it, so they are left alone.
    """
    env, notes = {}, []
    if "TF_CPP_MIN_LOG_LEVEL" not in environ:
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if backend == "torch" and num_processes > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"
        notes.append(
            f"note: OMP_NUM_THREADS=1 in each of the {num_processes} torch processes (as "
            "torchrun sets it), so that they do not oversubscribe the cores; set "
            "OMP_NUM_THREADS yourself to tune it."
        )
    return env, notes


# An absl log line (TensorFlow's, XLA's): severity letter, date, time, thread, file:line].
_ABSL_LINE = re.compile(r"(?:\[rank\d+\]: )?([IWEF])\d{4} [\d:.]+ +\d+ [\w.-]+:\d+\] ")
_ABSL_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_ABSL_PRELUDE = "WARNING: All log messages before absl::InitializeLog() is called are written"
# jaxlib's Gloo (CPU collectives) prints this for every communicator it makes, without a
# log level to turn it off; only a line where some peer is missing says anything.
_GLOO_CONNECTED = re.compile(
    r"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    r"Expected number of connected peer ranks is : (\d+)$"
)


class OutputFilter:
    """Which child lines the launcher leaves out: start-up noise that cannot be quieted at
    its source.

    - absl lines below `TF_CPP_MIN_LOG_LEVEL` (as the children get it), and absl's notice
      that precedes them: TensorFlow's start-up lines are logged before absl's log is
      initialized, where TensorFlow's level does not reach them (and each is printed twice,
      by two of its libraries); on a host without an NVIDIA driver, TensorFlow's failed
      `cuInit` too, logged as an error though it only says there is no GPU;
    - jaxlib's `[Gloo] Rank r is connected to k peer ranks` when all k are (16 lines in a
      short JAX launch), never one where a peer is missing.
    """

    def __init__(self, environ: dict[str, str]):
        try:
            self.level = int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
        except ValueError:
            self.level = 0
        self.no_gpu = not os.path.exists("/dev/nvidiactl")

    def keep(self, line: str) -> bool:
        if self.level > 0:
            match = _ABSL_LINE.match(line)
            if match and _ABSL_SEVERITY[match.group(1)] < self.level:
                return False
            if line.startswith(_ABSL_PRELUDE):
                return False
            if match and self.no_gpu and "failed call to cuInit" in line:
                return False
        gloo = _GLOO_CONNECTED.search(line)
        return not (gloo and gloo.group(1) == gloo.group(2))


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}"
    return f"exit code {code}"


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # Linux: a process whose launcher was killed (SIGKILL cannot be caught) goes too,
    # instead of waiting for ever on peers that will not come.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Launch:
    """The processes of one launch, their output pumps, and how they end."""

    def __init__(self, command: list[str], num_processes: int, ports: list[int], **options):
        self.command = command
        self.num_processes = num_processes
        self.ports = ports
        self.devices_per_process = options.get("devices_per_process")
        self.grace = options.get("grace", DEFAULT_GRACE_S)
        self.stall = options.get("stall", DEFAULT_STALL_S)
        self.out = options.get("out", sys.stdout)
        self.err = options.get("err", sys.stderr)
        self.defaults = options.get("defaults", {})
        self.filter = OutputFilter(dict(self.defaults, **os.environ))
        self.processes: list[subprocess.Popen] = []
        self._pumps: list[threading.Thread] = []
        self._reapers: list[threading.Thread] = []
        # When each process's error came (monotonic s): the start of the traceback that ends
        # it, else its end (`_error_at`). What a launch names as its cause is the first of them.
        # `_traceback_at` holds a process's last traceback only while it may still be the one
        # its end follows (`_pump` drops it once the process goes on).
        self._traceback_at: dict[int, float] = {}
        self._ended_at: dict[int, float] = {}
        self._write = threading.Lock()
        self._stopping: str | None = None  # Why the processes were told to stop.
        # Since when each process has been seen stopped (monotonic s; `_watch_stops`), and
        # the one named as having stopped answering, with how long it had been stopped.
        self._stopped_since: dict[int, float] = {}
        self._stalled: tuple[int, float] | None = None

    def say(self, message: str) -> None:
        with self._write:
            print(f"keras-accel launch: {message}", file=self.err, flush=True)

    def start(self) -> None:
        for index in range(self.num_processes):
            env = dict(self.defaults, **os.environ)
            env.update(process_env(index, self.ports, self.devices_per_process))
            process = subprocess.Popen(
                self.command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            self.processes.append(process)
            pump = threading.Thread(target=self._pump, args=(index, process), daemon=True)
            pump.start()
            self._pumps.append(pump)
            reaper = threading.Thread(target=self._reap, args=(index, process), daemon=True)
            reaper.start()
            self._reapers.append(reaper)

    def _pump(self, index: int, process: subprocess.Popen) -> None:
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            now = time.monotonic()
            if "Traceback (most recent call last):" in line:
                self._traceback_at[index] = now
            elif now - self._traceback_at.get(index, now) > TRACEBACK_SETTLE_S:
                # Output that goes on after the traceback printed: the process went on (a
                # logged, caught exception; a warning's stack), so that traceback is not the
                # error it will end with. Filtered lines count too.
                self._traceback_at.pop(index, None)
            if not self.filter.keep(line):
                continue
            with self._write:
                print(f"[{index}] {line}", file=self.out, flush=True)
        process.stdout.close()

    def _reap(self, index: int, process: subprocess.Popen) -> None:
        # A thread blocked on each process notes its end when it comes, not at the next
        # poll: two processes that fail within one poll are still told apart.
        process.wait()
        self._ended_at[index] = time.monotonic()

    def signal_all(self, signum: int) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signum)

    def stop(self, reason: str) -> None:
        """SIGTERM to every process still running; SIGKILL to those left after the grace."""
        if self._stopping is None:
            self._stopping = reason
            self.signal_all(signal.SIGTERM)
            self._deadline = time.monotonic() + self.grace

    def _error_at(self, index: int, now: float) -> float | None:
        """When process `index`'s error came: the start of the traceback its end follows, else
        its end; None for a process still running without such a traceback.

        Only a traceback that belongs to the end counts. A process may print one and go on
        (a caught exception it logs at start-up, a warning with its stack), and when a peer's
        failure later ends it without a traceback of its own (gloo's C++ abort on a closed
        connection), that old traceback would make it look like the first to fail. A
        traceback is the process's own end only if (1) nothing the process printed came more
        than `TRACEBACK_SETTLE_S` after it began (a fatal traceback is printed at once and is
        followed at most by the exit's own lines; `_pump` drops it otherwise), and (2) the
        process ended, or is still running, at most `TRACEBACK_END_S` after it began (a silent
        process that ran on for longer went on from it). A fatal traceback dropped by these
        rules (a script that logs its error, then cleans up for long) leaves the process
        ordered by its end, which still comes before the errors of the peers its end breaks.
        A traceback read after the end (its pump was slow to read) came before it: the end
        bounds it."""
        ended = self._ended_at.get(index)
        traceback = self._traceback_at.get(index)
        if traceback is None or (now if ended is None else ended) - traceback > TRACEBACK_END_S:
            return ended
        return traceback if ended is None else min(traceback, ended)

    def _cause(self, codes: list) -> list:
        """The exit codes once a process failed, after a short look at the others: a peer
        that lost the failed one through a collective (gloo's closed connection) fails too,
        and may end first, or in the same poll. A process still running whose traceback
        (one its end may follow, `_error_at`) came before every failure seen is waited for
        longer: its error came first, and it may only be slow to exit; the wait ends when it
        ends, goes on printing, or `TRACEBACK_END_S` after that traceback, so that the process
        named is always one that ended, with its own exit code."""
        deadline = time.monotonic() + CAUSE_WINDOW_S
        while not any(c == -signal.SIGKILL for c in codes) and any(c is None for c in codes):
            now = time.monotonic()
            if now >= deadline and not self._failing_first(codes, now):
                break
            time.sleep(0.02)
            codes = [process.poll() for process in self.processes]
        # Every ended process's last lines read (a traceback printed just before its end may
        # still be in the pipe) and its end noted, before they are compared. A pump can wait
        # longer than its process only for a grandchild that kept the pipe open: bounded.
        until = time.monotonic() + CAUSE_WINDOW_S
        for index, code in enumerate(codes):
            if code is not None:
                self._pumps[index].join(timeout=max(0.0, until - time.monotonic()))
                self._reapers[index].join(timeout=1.0)
        return codes

    def _failing_first(self, codes: list, now: float) -> list[int]:
        """Processes still running whose traceback, one their end may follow, came before
        every failed process's error."""
        errors = [self._error_at(i, now) for i, c in enumerate(codes) if c not in (None, 0)]
        first = min((now if e is None else e for e in errors), default=now)
        running = {i: self._error_at(i, now) for i, c in enumerate(codes) if c is None}
        return [i for i, error in running.items() if error is not None and error < first]

    def _first_failure(self, codes: list) -> tuple[int, int]:
        """The failed process to name: one killed by SIGKILL (it printed nothing, and its
        peers' errors may come before its end is seen), else the one whose error came
        first (`_error_at`): the start of the traceback it ended with, else its end. A peer
        fails only after the failed process closed its connections, which it does after
        printing its traceback, so its own error comes later, whatever the indices. Only
        processes that ended are candidates (`_cause` waits for one whose error came first)."""
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        for index, _ in failed:  # Its end is noted a moment after its exit code is known.
            self._reapers[index].join(timeout=1.0)
        now = time.monotonic()

        def order(item):
            index, code = item
            error = self._error_at(index, now)
            return (code != -signal.SIGKILL, now if error is None else error, index)

        return min(failed, key=order)

    def _watch_stops(self, codes: list) -> None:
        """Note which running processes are stopped (state T: SIGSTOP, a stuck host's job
        control), and since when: such a process answers no collective, and its peers
        fail on it later, each naming only itself."""
        now = time.monotonic()
        for index, code in enumerate(codes):
            if code is None and process_state(self.processes[index].pid) == "T":
                self._stopped_since.setdefault(index, now)
            else:
                self._stopped_since.pop(index, None)

    def _stopped_first(self) -> tuple[int, float] | None:
        """(index, seconds stopped) of the process stopped longest, or None."""
        self._watch_stops([process.poll() for process in self.processes])
        if not self._stopped_since:
            return None
        index = min(self._stopped_since, key=self._stopped_since.get)
        return index, time.monotonic() - self._stopped_since[index]

    def _stop_stalled(self, index: int, why: str) -> None:
        """Name process `index` as the one that stopped answering, SIGKILL it (stopped, it
        would act on nothing; its end frees the peers waiting on it) and stop the others."""
        self._stalled = index, time.monotonic() - self._stopped_since[index]
        self.say(
            f"process {index} (pid {self.processes[index].pid}) stopped answering: {why}. "
            f"SIGKILL to it; stopping the others (SIGTERM, SIGKILL after {self.grace:g} s)."
        )
        with contextlib.suppress(ProcessLookupError):
            self.processes[index].kill()
        self.stop(f"process {index} stopped answering")

    def wait(self) -> int:
        """Watch the processes until all have ended; the launch's exit code."""
        failed: tuple[int, int] | None = None
        killed = False
        while True:
            codes = [process.poll() for process in self.processes]
            if all(code is not None for code in codes):
                break
            stopped = self._stopped_first() if self._stopping is None else None
            if failed is None and self._stopping is None and any(c not in (None, 0) for c in codes):
                codes = self._cause(codes)
                failed = index, code = self._first_failure(codes)
                if stopped is not None:
                    # Its peers fail on it (a collective that timed out, a lost
                    # connection): the cause is the process that stopped, not them.
                    self._stop_stalled(
                        stopped[0],
                        f"it has been stopped (state T: SIGSTOP, job control) for "
                        f"{stopped[1]:.0f} s, and process {index} failed on it "
                        f"({describe_exit(code)})",
                    )
                    continue
                others = sum(c is None for c in codes)
                self.say(
                    f"process {index} (pid {self.processes[index].pid}) failed: "
                    f"{describe_exit(code)}. Stopping the other {others} process(es) "
                    f"(SIGTERM, SIGKILL after {self.grace:g} s)."
                )
                self.stop(f"process {index} failed")
            elif stopped is not None and self.stall and stopped[1] > self.stall:
                self._stop_stalled(
                    stopped[0],
                    f"it has been stopped (state T: SIGSTOP, job control) for more than "
                    f"--stall-timeout {self.stall:g} s",
                )
            if self._stopping is not None and not killed and time.monotonic() > self._deadline:
                left = [i for i, c in enumerate(codes) if c is None]
                self.say(
                    f"process(es) {left} still running {self.grace:g} s after SIGTERM "
                    f"({self._stopping}): SIGKILL."
                )
                self.signal_all(signal.SIGKILL)
                killed = True
            time.sleep(0.05)
        for pump in self._pumps:
            pump.join(timeout=5)
        codes = [process.returncode for process in self.processes]
        if failed is None and self._stopping is None and any(codes):
            failed = self._first_failure(codes)  # All ended in one poll.
        if self._stalled is not None:
            index, seconds = self._stalled
            self.say(
                f"failed: process {index} stopped answering (stopped for {seconds:.0f} s); "
                f"exit codes {codes}."
            )
            code = codes[index]
            return code if code > 0 else 128 - code
        if failed is not None:
            index, code = failed
            self.say(f"failed: process {index} ({describe_exit(code)}); exit codes {codes}.")
            return code if code > 0 else 128 - code
        if codes and all(code == 143 for code in codes):
            self.say(f"preempted ({self._stopping}): every process saved and exited (143).")
            return 143
        if any(codes):
            self.say(f"stopped ({self._stopping or 'a process failed'}); exit codes {codes}.")
            bad = next(c for c in codes if c)
            return bad if bad > 0 else 128 - bad
        return 0


# How long a failure waits for the others' ends before it names the first (a SIGKILL at once).
CAUSE_WINDOW_S = 1.0
# A traceback is the error a process ends with only while nothing it prints comes more than
# TRACEBACK_SETTLE_S after the traceback began, and only if the process ends within
# TRACEBACK_END_S of it (`Launch._error_at`).
TRACEBACK_SETTLE_S = 2.0
TRACEBACK_END_S = 10.0


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process `pid` (R, S, D, T...), or None where it
    cannot be read (gone, or no /proc: the stall watch is then off)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # `pid (comm) state ...`: the name may hold spaces and parentheses; the state follows
    # the last ')'.
    rest = stat.rpartition(")")[2].split()
    return rest[0] if rest else None


def devices_per_process_note(devices_per_process: int | None, num_processes: int) -> str | None:
    """Why `--devices-per-process` does nothing under the launcher's backend, or None where it
    applies (JAX). It sets `JAX_NUM_CPU_DEVICES`, which only JAX reads; a TensorFlow worker
    under MultiWorkerMirroredStrategy computes on one CPU device, whatever the split."""
    if devices_per_process is None:
        return None
    from keras_accel.cli.backend import configured_backend

    backend, source = configured_backend()
    if backend == "jax":
        return None
    if backend == "tensorflow":
        why = (
            "a TensorFlow worker (MultiWorkerMirroredStrategy) computes on one CPU device (or "
            f"every local GPU), so on CPU this launch has {num_processes} replica(s), one per "
            "process"
        )
    else:
        why = f"the {backend} backend does not distribute"
    return (
        f"note: --devices-per-process {devices_per_process} is ignored on the {backend} backend "
        f"({source}): it sets JAX_NUM_CPU_DEVICES, which only JAX reads, and {why}."
    )


def run(args: argparse.Namespace) -> int:
    if args.num_processes < 1:
        raise ValueError(f"-n/--num-processes must be at least 1. Received: {args.num_processes}")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise ValueError(
            f"--devices-per-process must be at least 1. Received: {args.devices_per_process}"
        )
    if args.grace < 0:
        raise ValueError(f"--grace must be 0 or more seconds. Received: {args.grace}")
    if args.stall_timeout < 0:
        raise ValueError(
            f"--stall-timeout must be 0 (never) or more seconds. Received: {args.stall_timeout}"
        )
    if not os.path.isfile(args.script):
        raise ValueError(f"No such script: {args.script!r}. Pass the path of a Python file.")
    missing = missing_backend_error()
    if missing:
        raise RuntimeError(missing)
    from keras_accel.cli.backend import configured_backend

    n = args.num_processes
    ports = free_ports(n) if args.port is None else [args.port + i for i in range(n)]
    command = [sys.executable, args.script, *args.args]
    defaults, notes = child_defaults(configured_backend()[0], n, dict(os.environ))
    launch = Launch(
        command,
        n,
        ports,
        devices_per_process=args.devices_per_process,
        grace=args.grace,
        stall=args.stall_timeout,
        defaults=defaults,
    )
    for note in [devices_per_process_note(args.devices_per_process, n), *notes]:
        if note:
            launch.say(note)

    def forward(signum, frame):
        launch.say(f"{signal.Signals(signum).name}: passing SIGTERM to every process.")
        launch.stop(f"{signal.Signals(signum).name} to the launcher")

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch.start()
        return launch.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
