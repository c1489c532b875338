"""Launch backends: how the cluster scheduler starts, watches and stops its jobs' processes (local, or Ray)."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, Self

from conveyor.errors import InputError

__all__ = ["LOST", "Backend", "Launched", "LocalBackend", "RayBackend"]

LOST = 255  # the exit code of a command Ray lost (its worker or node died, or it would not stop)
_CHECK_S = 0.25  # how often a Ray task looks for a stop request while its command runs


@dataclass(eq=False)
class Launched:
    """A command a backend launched: what it was asked to run, and the backend's handle on it.

    Attributes:
        name: the job's name (for logs and Ray's task name).
        argv: the command.
        device_type: the device type it was placed on (a Ray custom resource).
        devices: how many devices of that type it holds while it runs.
        log: the file its stdout and stderr go to.
        started_at: ``time.time()`` when it was launched (a Ray task may wait for devices after that).
        returncode: its exit code once a poll or stop has seen it end, else ``None``.
    """

    name: str
    argv: list[str]
    device_type: str
    devices: int
    log: Path
    started_at: float = field(default_factory=time.time)
    returncode: int | None = None
    handle: Any = field(default=None, repr=False)


class Backend(Protocol):
    """What the scheduler needs of a way to run job processes."""

    def launch(
        self,
        name: str,
        argv: list[str],
        *,
        device_type: str,
        devices: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> Launched:
        """Start ``argv`` on ``devices`` devices of ``device_type``, its output in ``log``; ``env`` is added to
        the environment."""
        ...

    def poll(self, launched: Launched) -> int | None:
        """The command's exit code, ``None`` while it runs (or waits for devices)."""
        ...

    def stop(self, launched: Launched, grace_s: float = 10.0) -> int:
        """SIGTERM the command's whole process group, SIGKILL it after ``grace_s``; return the exit code."""
        ...

    def close(self) -> None:
        """Stop every command still running and release what the backend holds."""
        ...


# Sets PR_SET_PDEATHSIG (1) to SIGKILL, then becomes the command: it dies with the thread that started it.
# (A preexec_fn would do it in the child, but is unsafe in a multi-threaded process such as a Ray worker.)
_TIED = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(137); os.execvp(sys.argv[2], sys.argv[2:])"
)


def _spawn(
    argv: list[str], log: Path, env: dict[str, str] | None, cwd: str | None, tie: bool
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session (and process group) of its own, output to ``log``, in the environment ``env``
    (``None``: this process's). ``tie``: on Linux the command gets SIGKILL if the thread that starts it dies,
    so a killed Ray worker leaves no orphan."""
    log.parent.mkdir(parents=True, exist_ok=True)
    if tie and sys.platform.startswith("linux"):
        argv = [sys.executable, "-c", _TIED, str(os.getpid()), *argv]
    with log.open("ab") as out:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd if cwd and os.path.isdir(cwd) else None,
        )


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _terminate(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM ``proc``'s process group, SIGKILL it after ``grace_s`` (whatever of it is left then)."""
    if proc.poll() is None:
        _signal_group(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    _signal_group(proc.pid, signal.SIGKILL)  # the leader gone, its group may still hold children
    return proc.wait()


class _Tracking:
    """What both backends share: the launches still running, and closing them on leaving a ``with`` block."""

    _running: list[Launched]

    def close(self) -> None:
        raise NotImplementedError

    def _ended(self, launched: Launched, code: int) -> None:
        launched.returncode = code
        with contextlib.suppress(ValueError):
            self._running.remove(launched)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalBackend(_Tracking):
    """Runs every command as a process group on this machine (device types are only labels here).

    ``close`` (also at interpreter exit, and at the end of a ``with`` block) stops whatever still runs.

    Example:
        >>> with LocalBackend() as backend:
        ...     job = backend.launch(
        ...         "hello", [sys.executable, "-c", "pass"], device_type="cpu", devices=1, log=Path(os.devnull)
        ...     )
        ...     while backend.poll(job) is None:
        ...         time.sleep(0.01)
        >>> job.returncode
        0
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s  # what close gives each command between SIGTERM and SIGKILL
        self._running: list[Launched] = []
        atexit.register(self.close)

    def launch(
        self,
        name: str,
        argv: list[str],
        *,
        device_type: str,
        devices: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> Launched:
        launched = Launched(name, list(argv), device_type, devices, Path(log))
        launched.handle = _spawn(launched.argv, launched.log, {**os.environ, **env} if env else None, None, False)
        self._running.append(launched)
        return launched

    def poll(self, launched: Launched) -> int | None:
        if launched.returncode is None and (code := launched.handle.poll()) is not None:
            _signal_group(launched.handle.pid, signal.SIGKILL)  # anything it left behind in its group
            self._ended(launched, code)
        return launched.returncode

    def stop(self, launched: Launched, grace_s: float = 10.0) -> int:
        if launched.returncode is None:
            self._ended(launched, _terminate(launched.handle, grace_s))
        assert launched.returncode is not None
        return launched.returncode

    def close(self) -> None:
        for launched in list(self._running):
            self.stop(launched, self.grace_s)
        atexit.unregister(self.close)


class _StopBoard:
    """A Ray actor through which the driver asks running tasks to stop (a task cannot be sent a message)."""

    def __init__(self) -> None:
        self.begun: set[str] = set()
        self.stops: dict[str, float] = {}

    def begin(self, key: str) -> bool:
        """A task is about to start its command: False if it was stopped before it could."""
        self.begun.add(key)
        return key not in self.stops

    def stop(self, key: str, grace_s: float) -> bool:
        """Ask ``key``'s task to stop; whether it had begun its command."""
        self.stops[key] = grace_s
        return key in self.begun

    def grace(self, key: str) -> float | None:
        """The grace period a stop request gave ``key``, ``None`` if there is none."""
        return self.stops.get(key)


# What Ray sets in its workers' environment for them alone; a command gets the driver's OMP_NUM_THREADS (or none).
_RAY_WORKER_ONLY = ("OMP_NUM_THREADS", "PYTHONBREAKPOINT", "RAY_JOB_ID", "RAY_RAYLET_PID", "RAY_CLIENT_MODE")


def _run_command(
    argv: list[str], log: str, env: dict[str, str], cwd: str | None, board: Any, key: str
) -> int:  # pragma: no cover - runs inside a Ray worker
    """A Ray task: run the command where its devices are, until it ends or the board asks it to stop."""
    import ray

    if not ray.get(board.begin.remote(key)):
        return -signal.SIGTERM
    base = {k: v for k, v in os.environ.items() if k not in _RAY_WORKER_ONLY}
    proc = _spawn(argv, Path(log), {**base, **env}, cwd, tie=True)
    try:
        while True:
            try:
                return proc.wait(timeout=_CHECK_S)
            except subprocess.TimeoutExpired:
                grace = ray.get(board.grace.remote(key))
                if grace is not None:
                    return _terminate(proc, grace)
    finally:
        _signal_group(proc.pid, signal.SIGKILL)  # nothing of it outlives the task
        proc.wait()


class RayBackend(_Tracking):
    """Runs every command as a Ray task that holds ``{device_type: devices}`` of Ray's custom resources, on
    whichever node has them free; a command whose devices are taken waits in Ray's queue until they free up.

    Args:
        address: a running Ray cluster (``"auto"``, ``"ray://HOST:PORT"``...); ``None`` starts a local Ray
            instance with ``resources`` (e.g. ``{"fast": 2, "slow": 4}``) and ``num_cpus``, shut down by ``close``.
        resources: the local instance's devices per type (with ``address``, the cluster's nodes declare theirs).
        num_cpus: the local instance's CPUs (default: this machine's); the tasks themselves ask for none.
        grace_s: what ``close`` gives each command between SIGTERM and SIGKILL.

    The log paths, ``argv``'s program and the working directory must exist on every node (a shared file
    system); a command runs in the Ray worker's environment less what Ray sets for its workers alone
    (``OMP_NUM_THREADS`` is the driver's), plus ``env``, in the driver's working directory where it exists.

    Raises:
        ValueError: Ray is not installed.
    """

    def __init__(
        self,
        address: str | None = None,
        resources: dict[str, float] | None = None,
        num_cpus: int | None = None,
        grace_s: float = 10.0,
    ) -> None:
        try:
            import ray
        except ImportError as exc:
            raise InputError(f"the Ray backend needs Ray ({exc}): pip install 'conveyor[ray]'") from None
        self._ray = ray
        self.grace_s = grace_s
        self._owns = not ray.is_initialized()
        if self._owns:
            options: dict[str, Any] = {"log_to_driver": False, "logging_level": "WARNING"}
            if address is None:  # a local instance of our own
                options.update(resources=dict(resources or {}), num_cpus=num_cpus, include_dashboard=False)
            ray.init(address=address, **options)
        self._board: Any = ray.remote(num_cpus=0)(_StopBoard).remote()
        self._task: Any = ray.remote(num_cpus=0, max_retries=0)(_run_command)
        self._running: list[Launched] = []
        self._count = 0
        atexit.register(self.close)

    def launch(
        self,
        name: str,
        argv: list[str],
        *,
        device_type: str,
        devices: int,
        log: Path,
        env: dict[str, str] | None = None,
    ) -> Launched:
        """Queue the command's task; it starts once a node has ``devices`` of ``device_type`` free.

        Raises:
            ValueError: no node of the cluster declares that many devices of the type.
        """
        total = self._ray.cluster_resources().get(device_type, 0)
        if total < devices:
            raise InputError(
                f"{name}: the Ray cluster has {total:g} {device_type!r} devices, the job needs {devices}: start "
                f"its nodes with --resources '{{\"{device_type}\": N}}' (RayBackend(resources=...) locally)"
            )
        self._count += 1
        key = f"{self._count}:{name}"
        launched = Launched(name, list(argv), device_type, devices, Path(log))
        threads = {"OMP_NUM_THREADS": os.environ["OMP_NUM_THREADS"]} if "OMP_NUM_THREADS" in os.environ else {}
        ref = self._task.options(name=name, resources={device_type: float(devices)}).remote(
            launched.argv, str(Path(log).absolute()), {**threads, **(env or {})}, os.getcwd(), self._board, key
        )
        launched.handle = (ref, key)
        self._running.append(launched)
        return launched

    def poll(self, launched: Launched) -> int | None:
        if launched.returncode is None:
            ref, _ = launched.handle
            ready, _ = self._ray.wait([ref], timeout=0)
            if ready:
                self._ended(launched, self._result(ref))
        return launched.returncode

    def stop(self, launched: Launched, grace_s: float = 10.0) -> int:
        if self.poll(launched) is None:
            ref, key = launched.handle
            if not self._ray.get(self._board.stop.remote(key, grace_s)):
                self._ray.cancel(ref)  # still waiting for devices: out of the queue (it will not start now)
            try:
                code = self._result(ref, timeout=grace_s + 15)
            except self._ray.exceptions.GetTimeoutError:  # the task does not answer: kill its worker
                self._ray.cancel(ref, force=True)  # its command dies with it (PR_SET_PDEATHSIG)
                code = LOST
            self._ended(launched, code)
        assert launched.returncode is not None
        return launched.returncode

    def close(self) -> None:
        atexit.unregister(self.close)
        if not self._ray.is_initialized():
            return
        for launched in list(self._running):
            self.stop(launched, self.grace_s)
        with contextlib.suppress(Exception):
            self._ray.kill(self._board)
        if self._owns:
            self._ray.shutdown()

    def _result(self, ref: Any, timeout: float | None = None) -> int:
        """The task's exit code; a task cancelled before it began counts as terminated, a lost one as LOST."""
        ray = self._ray
        try:
            return int(ray.get(ref, timeout=timeout))
        except ray.exceptions.TaskCancelledError:
            return -signal.SIGTERM
        except ray.exceptions.GetTimeoutError:
            raise
        except ray.exceptions.RayError:
            return LOST
