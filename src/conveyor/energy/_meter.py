"""Energy meters for training windows: a worker's joules through Zeus (GPU by NVML, CPU/DRAM by RAPL), or replayed."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from conveyor.config import METER_RANK, split_meter_spec

__all__ = ["Meter", "MeterStatus", "describe_meters", "open_meter"]

_NO_METER = "no energy meter readable here ({}): energy is not recorded"
POWERCAP = "/sys/class/powercap"  # where the kernel puts RAPL's counters, which Zeus reads


@dataclass(frozen=True)
class MeterStatus:
    """What one worker's meter is, picklable: whether it reads, what it reads, or why not.

    ``delegated`` marks a worker with nothing of its own to measure (no GPU, and its host's CPU is measured by
    the host's local rank 0): its lack of a meter leaves no gap.
    """

    available: bool
    description: str | None
    reason: str | None
    delegated: bool = False


class Meter:
    """One worker's energy meter: :meth:`begin` and :meth:`end` bound a window, :meth:`end` gives its joules.

    The joules are those of the devices this worker measures (its GPU, and its host's CPU packages and DRAM
    when it is the host's measuring worker), summed. A meter that cannot read anything is not
    :attr:`available`: its windows give None and :attr:`reason` says why in one line; a meter that fails while
    reading becomes unavailable the same way. Use it as a context manager (or call :meth:`close`): Zeus may
    start helper processes that must stop with it. A closed meter's windows give None; its :meth:`status` still
    tells what it read.

    Example:
        >>> with open_meter("off") as meter:
        ...     meter.begin()
        ...     print(meter.available, meter.end(), meter.reason)
        False None energy metering is off (--energy-meter off)
    """

    def __init__(
        self, monitor: Any = None, description: str | None = None, reason: str | None = None, delegated: bool = False
    ) -> None:
        self._monitor = monitor
        self._description = description
        self.reason: str | None = None if monitor is not None else (reason or "no energy meter")
        self.delegated = delegated
        self._windows = 0
        self._open: str | None = None

    @property
    def available(self) -> bool:
        """Whether this meter reads energy (until it is closed, its windows give joules rather than None)."""
        return self.reason is None

    def describe(self) -> str:
        """What this meter reads, e.g. ``"zeus 0.16: GPU 0 (NVML), CPU 0 (RAPL)"``; ``"no meter: REASON"`` if none."""
        return self._description if self.available and self._description else f"no meter: {self.reason}"

    def status(self) -> MeterStatus:
        """This meter's :class:`MeterStatus`, to send to another worker."""
        description = self._description if self.available else None
        return MeterStatus(self.available, description, self.reason, self.delegated)

    def begin(self) -> None:
        """Start a window (a window still open is dropped)."""
        if self._monitor is None:
            return
        try:
            if self._open is not None:
                self._monitor.end_window(self._open, cancel=True)
            self._windows += 1
            self._open = f"conveyor-window-{self._windows}"
            self._monitor.begin_window(self._open)
        except Exception as exc:
            self._fail(exc)

    def end(self) -> float | None:
        """End the window :meth:`begin` started: its joules (GPU + CPU + DRAM), or None when nothing is read."""
        if self._monitor is None or self._open is None:
            return None
        key, self._open = self._open, None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. a window shorter than the GPU counter's update period
                m = self._monitor.end_window(key)
        except Exception as exc:
            self._fail(exc)
            return None
        return float(
            sum(m.gpu_energy.values()) + sum((m.cpu_energy or {}).values()) + sum((m.dram_energy or {}).values())
        )

    def close(self) -> None:
        """Stop the helper processes Zeus started (RAPL wrap-around trackers, power pollers) and the replay log."""
        monitor, self._monitor = self._monitor, None
        if monitor is None:
            return
        with contextlib.suppress(Exception):
            if getattr(monitor, "power_monitor", None) is not None:
                monitor.power_monitor.stop()
        for cpu in getattr(getattr(monitor, "cpus", None), "cpus", ()):
            for rapl in (getattr(cpu, "rapl_file", None), getattr(cpu, "dram", None)):
                tracker = getattr(rapl, "_wraparound_tracker", None)  # a process, started on the first read
                if tracker is not None:
                    with contextlib.suppress(Exception):
                        tracker._stop()
        log = getattr(monitor, "log_file", None)
        if log is not None and hasattr(log, "close"):
            log.close()

    def _fail(self, exc: Exception) -> None:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        self.reason = f"{self.describe()} stopped reading at window {self._windows}: {first}"  # now unavailable
        self.close()

    def __enter__(self) -> Meter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def open_meter(spec: str = "auto", *, gpu_index: int | None = None, measure_host: bool = True, rank: int = 0) -> Meter:
    """This worker's energy meter.

    Args:
        spec: ``"auto"``: Zeus' ``ZeusMonitor`` over this worker's GPU (``gpu_index``, through NVML) and, if
            ``measure_host``, its host's CPU packages and DRAM (RAPL); ``"off"``: no meter; ``"replay:PATH"``:
            Zeus' ``ReplayZeusMonitor`` over a CSV log in Zeus' format
            (``start_time,window_name,elapsed_time,gpu0_energy,...``): each window reads the next row (its
            window name is not checked) and gives the sum of its ``gpuN_energy`` columns. ``{rank}`` in PATH is
            replaced by ``rank``, so each worker replays its own log; without it every worker replays the same
            one. A replay log that is missing or unreadable gives an unavailable meter.
        gpu_index: this worker's CUDA device index (None when it runs on the CPU).
        measure_host: whether this worker measures its host's CPU and DRAM. Exactly one worker per host should
            (local rank 0), or the host's CPU energy would be counted once per local worker.
        rank: this worker's rank (for ``{rank}`` in a replay PATH).

    Raises:
        ValueError: ``spec`` is none of those; one line says what is accepted.

    Example:
        >>> import pathlib, tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:  # worker 0's log of one window: 100 J + 50.5 J
        ...     log = pathlib.Path(tmp, "energy-0.csv")
        ...     _ = log.write_text("start_time,window_name,elapsed_time,gpu0_energy,gpu1_energy\\n0,e,2.5,100,50.5\\n")
        ...     with open_meter(f"replay:{tmp}/energy-{{rank}}.csv", rank=0) as meter:
        ...         meter.begin()
        ...         print(meter.end())
        150.5
    """
    kind, path = split_meter_spec(spec)
    if kind == "off":
        return Meter(reason="energy metering is off (--energy-meter off)")
    if path is not None:
        return _open_replay(path.replace(METER_RANK, str(rank)))
    if gpu_index is None and not measure_host:  # nothing of its own: no need to load Zeus
        return Meter(reason=_NO_METER.format("no GPU; its host's CPU is measured by local rank 0"), delegated=True)
    if gpu_index is None and not os.path.exists(POWERCAP):  # nothing Zeus could read: spare its import (1.7 s)
        return Meter(reason=_NO_METER.format(f"this worker uses no GPU, no RAPL under {POWERCAP}"))
    return _open_zeus(gpu_index, measure_host)


def _quiet_zeus() -> None:
    """Zeus logs what it probes (and warns, e.g. ROCm absent) on its ``zeus`` logger: errors only, unless the
    application set that logger's level itself."""
    logger = logging.getLogger("zeus")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)


def _zeus_version() -> str:
    import zeus

    return ".".join(str(zeus.__version__).split(".")[:2])


def _open_replay(path: str) -> Meter:
    if not os.path.isfile(path):
        return Meter(reason=f"no replay log at {path}: energy is not recorded")
    _quiet_zeus()
    from zeus.utils.testing import ReplayZeusMonitor

    try:
        monitor = ReplayZeusMonitor(log_file=path, ignore_sync_execution=True, match_window_name=False)
    except (OSError, ValueError) as exc:
        return Meter(reason=f"replay log {path} is unreadable ({exc}): energy is not recorded")
    if not monitor.gpu_indices:
        monitor.log_file.close()
        return Meter(reason=f"replay log {path} has no gpuN_energy column: energy is not recorded")
    gpus = ", ".join(map(str, monitor.gpu_indices))
    return Meter(monitor, f"zeus {_zeus_version()}: replay of {path} (GPU {gpus})")


def _open_zeus(gpu_index: int | None, measure_host: bool) -> Meter:
    _quiet_zeus()
    from zeus.device import get_cpus, get_gpus
    from zeus.device.cpu.common import ZeusCPUNoPermissionError
    from zeus.monitor import ZeusMonitor

    gpu_indices: list[int] = []
    cpu_indices: list[int] = []
    parts: list[str] = []
    missing: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            gpus: Any = get_gpus()
        except Exception:  # ZeusGPUInitError; ImportError for an unofficial pynvml
            gpus = None
        library = "AMD SMI" if type(gpus).__name__.startswith("AMD") else "NVML"
        if gpus is None or len(gpus) == 0:
            missing.append("no NVIDIA GPU through NVML")
        elif gpu_index is None:
            missing.append("this worker uses no GPU")
        elif not 0 <= gpu_index < len(gpus):
            missing.append(f"GPU {gpu_index} is not among the {len(gpus)} that {library} sees")
        else:
            gpu_indices.append(gpu_index)
            parts.append(f"GPU {gpu_index} ({library})")
        if measure_host:
            try:
                cpus: Any = get_cpus()
            except ZeusCPUNoPermissionError:
                missing.append(f"RAPL under {POWERCAP} is not readable without root")
            except Exception:  # ZeusCPUInitError and its kin
                missing.append(f"no RAPL under {POWERCAP}")
            else:
                cpu_indices = list(range(len(cpus)))
                for i in cpu_indices:
                    dram = "+DRAM" if cpus.cpus[i].supports_get_dram_energy_consumption() else ""
                    parts.append(f"CPU {i} (RAPL{dram})")
                if not cpu_indices:
                    missing.append(f"RAPL under {POWERCAP} lists no CPU package")
        if not gpu_indices and not cpu_indices:
            if not measure_host:
                missing.append("its host's CPU is measured by local rank 0")
            return Meter(reason=_NO_METER.format(", ".join(missing)))
        try:
            monitor = ZeusMonitor(gpu_indices=gpu_indices, cpu_indices=cpu_indices, approx_instant_energy=True)
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            return Meter(reason=f"Zeus could not start its monitor ({first}): energy is not recorded")
    if not monitor.gpu_indices and not monitor.cpu_indices:  # ZeusMonitor([], []) works, and measures nothing
        return Meter(reason=_NO_METER.format(", ".join(missing) or "Zeus found no device"))
    return Meter(monitor, f"zeus {_zeus_version()}: {', '.join(parts)}")


def describe_meters(statuses: Sequence[MeterStatus]) -> tuple[str | None, str | None]:
    """What a job's meters (one :class:`MeterStatus` per worker, by rank) read, and the one-line note a run
    reports: ``(description or None when no worker has a meter, note or None when every worker that has
    something to measure has its meter)``.

    Example:
        >>> ok, gone = MeterStatus(True, "zeus 0.16: GPU 0 (NVML)", None), MeterStatus(False, None, "no NVML")
        >>> description, note = describe_meters([ok, gone])
        >>> description
        'worker 0: zeus 0.16: GPU 0 (NVML)'
        >>> note
        "energy is the sum over 1 of 2 workers' meters: worker 1 has no meter (no NVML)"
        >>> describe_meters([gone])
        (None, 'no NVML')
    """
    read = [(rank, s) for rank, s in enumerate(statuses) if s.available]
    gaps = [(rank, s) for rank, s in enumerate(statuses) if not s.available and not s.delegated]
    if not read:
        first = gaps[0][1] if gaps else (statuses[0] if statuses else None)
        return None, (first.reason if first is not None else None) or "no energy meter"
    description = (
        "; ".join(f"worker {rank}: {s.description}" for rank, s in read)
        if len(statuses) > 1
        else (read[0][1].description)
    )
    if not gaps:
        return description, None
    by_reason: dict[str, list[int]] = {}
    for rank, s in gaps:
        by_reason.setdefault(s.reason or "no meter", []).append(rank)
    missing = "; ".join(
        f"worker{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
        f"{'have' if len(ranks) > 1 else 'has'} no meter ({reason})"
        for reason, ranks in by_reason.items()
    )
    return description, f"energy is the sum over {len(read)} of {len(read) + len(gaps)} workers' meters: {missing}"
