"""The GPU power limit of a training run (Zeus, NSDI'23): fixed, maximum, or profiled just in time."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

import torch

from conveyor.config import parse_power_limit
from conveyor.errors import InputError

__all__ = ["PowerLimits", "ProfiledLimit"]

log = logging.getLogger(__name__)

_NO_GPU = "--power-limit needs NVIDIA GPUs (CUDA); this run has none: drop --power-limit"
_NO_PRIVILEGE = "setting GPU power limits needs the SYS_ADMIN capability (root, or docker run --cap-add SYS_ADMIN)"


@dataclass(frozen=True)
class ProfiledLimit:
    """One power limit's profiling window: its limit (W), time (s) and energy (J, summed over the job's GPUs).

    Example:
        >>> ProfiledLimit(250, 4.2, 980.0).limit_w
        250
    """

    limit_w: int
    time_s: float
    energy_j: float


def _flat(err: BaseException) -> str:
    """An error's message on one line."""
    return " ".join(str(err).split()) or type(err).__name__


def _permission_error(err: BaseException) -> BaseException | None:
    """Zeus's ZeusGPUNoPermissionError behind ``err`` (itself, or the cause of the RuntimeError zeus wraps it in)."""
    from zeus.device.gpu import ZeusGPUNoPermissionError

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ZeusGPUNoPermissionError):
        cause = cause.__cause__
    return cause


@contextlib.contextmanager
def _privileged() -> Iterator[None]:
    """Turn a missing privilege to set power limits, however zeus reports it, into one line that says the fix."""
    try:
        yield
    except Exception as err:
        denied = _permission_error(err)
        if denied is None:
            raise
        raise RuntimeError(f"{_NO_PRIVILEGE}: {_flat(denied)}; grant it or drop --power-limit") from err


class PowerLimits:
    """This worker's GPU power limit for a run, restored to its original value however the run ends.

    ``spec`` is ``"max"`` (the GPU's maximum limit), a number of watts (checked against the GPU's allowed
    range), or ``"auto"``: zeus's ``GlobalPowerLimitOptimizer`` profiles, during the first steps, every
    limit from the maximum down to the minimum in steps of ``pl_step_w`` (``warmup_steps`` steps, then a
    ``profile_steps``-step window measuring time and energy; a window cut by an epoch's end is retried in
    the next epoch) and keeps the limit of least ``eta * energy + (1 - eta) * max_power * time``
    (``ZeusCost(eta, world_size)``; ``max_power`` is the largest limit times ``world_size``). With
    ``torch.distributed`` initialized, zeus all-reduces each window's time and energy over all ranks, so every
    rank must make the same ``step_begin`` / ``epoch_end`` calls and hold its own GPU.

    Every managed GPU's limit (and, for ``"auto"``, its persistence mode) is recorded before anything changes
    and written back by ``close()`` (or leaving the ``with`` block, normally or by an exception), at
    interpreter exit, and on SIGTERM (then the earlier SIGTERM handler, or the default, runs). Restoring
    twice is harmless: it writes only values that differ. Zeus registers an atexit callback that sets the
    maximum limit; ours is registered before it, so (atexit runs last-in first-out) ours runs after it and
    the original values win; ``close()`` also makes zeus's callback a no-op.

    Args:
        spec: ``"auto"``, ``"max"`` or whole watts (see :func:`conveyor.config.parse_power_limit`).
        eta: Weight of energy against time in ``"auto"``'s cost, in [0, 1] (1: energy alone, 0: time alone).
        gpu_index: This worker's GPU (CUDA's index, after ``CUDA_VISIBLE_DEVICES``).
        warmup_steps: Steps run at each limit before its profiling window (``"auto"``).
        profile_steps: Steps in each limit's profiling window (``"auto"``).
        pl_step_w: Watts between profiled limits (``"auto"``).
        wait_steps: Steps before profiling starts (``"auto"``; the first is often unrepresentative).
        world_size: GPUs in the job (``"auto"``'s cost); default: ``torch.distributed``'s world size, or 1.
        monitor: A ``zeus.monitor.ZeusMonitor`` watching ``gpu_index`` alone; default: a new one.

    Raises:
        ValueError: a bad ``spec``, ``eta`` or step count, a missing GPU index, or watts outside the range.
        RuntimeError: no CUDA / NVIDIA GPU, or no privilege to set power limits.

    Example (in a training loop; needs an NVIDIA GPU and SYS_ADMIN)::

        with PowerLimits("auto", eta=0.5, gpu_index=local_rank) as power:
            for epoch in range(epochs):
                for batch in loader:
                    power.step_begin()
                    train_step(batch)
                power.epoch_end()
        print(power.chosen, power.profile)  # e.g. 225 [ProfiledLimit(limit_w=300, ...), ...]
    """

    def __init__(
        self,
        spec: str | int,
        *,
        eta: float = 0.5,
        gpu_index: int = 0,
        warmup_steps: int = 10,
        profile_steps: int = 40,
        pl_step_w: int = 25,
        wait_steps: int = 1,
        world_size: int | None = None,
        monitor: Any = None,
    ) -> None:
        self.spec = parse_power_limit(spec)
        if not 0.0 <= eta <= 1.0:
            raise InputError(f"eta weighs energy against time and must lie in [0, 1], got {eta}")
        for name, value, least in (("warmup_steps", warmup_steps, 1), ("profile_steps", profile_steps, 1)):
            if value < least:
                raise InputError(f"{name} must be at least {least}, got {value}")
        if pl_step_w < 1 or wait_steps < 0:
            raise InputError(f"pl_step_w must be >= 1 and wait_steps >= 0, got {pl_step_w} and {wait_steps}")
        if not torch.cuda.is_available():
            raise RuntimeError(_NO_GPU)
        from zeus.device.gpu import ZeusBaseGPUError
        from zeus.optimizer import power_limit as zpl  # its get_gpus: the one its optimizer uses

        try:
            with _privileged():
                self._gpus = zpl.get_gpus()
        except ZeusBaseGPUError as err:  # NVML missing or failing (not a missing privilege: that is re-raised)
            raise RuntimeError(f"{_NO_GPU} ({_flat(err)})") from err
        if not 0 <= gpu_index < len(self._gpus):
            raise InputError(f"GPU index {gpu_index} does not exist: NVML sees {len(self._gpus)} GPU(s)")
        self.gpu_index = gpu_index
        try:
            low_mw, high_mw = self._gpus.get_power_management_limit_constraints(gpu_index)
            original_mw = self._gpus.get_power_management_limit(gpu_index)
        except ZeusBaseGPUError as err:  # e.g. a GPU without power management
            raise RuntimeError(f"GPU {gpu_index} reports no power limits ({_flat(err)}): drop --power-limit") from err
        if isinstance(self.spec, int) and not math.ceil(low_mw / 1000) <= self.spec <= high_mw // 1000:
            raise InputError(
                f"--power-limit {self.spec} W is outside GPU {gpu_index}'s allowed range "
                f"{math.ceil(low_mw / 1000)}..{high_mw // 1000} W: pick a wattage in it, or 'max' or 'auto'"
            )
        self._chosen_mw = high_mw if self.spec == "max" else self.spec * 1000 if isinstance(self.spec, int) else None
        self._optimizer: Any = None
        self._closed = False
        # Record BEFORE changing anything; then the hooks that put these values back.
        self._original_mw = {gpu_index: original_mw}
        self._original_persistence: dict[int, bool] = {}
        if self.spec == "auto":
            with contextlib.suppress(Exception):  # not every platform reports it; then it is left as zeus sets it
                self._original_persistence[gpu_index] = self._gpus.get_persistence_mode(gpu_index)
        atexit.register(self._at_exit)  # before zeus registers its own: atexit is LIFO, so ours runs after it
        self._previous_sigterm: Any = None
        self._install_sigterm()
        try:
            with _privileged():
                if self.spec == "auto":
                    if world_size is None:
                        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
                        world_size = torch.distributed.get_world_size() if initialized else 1
                    if monitor is None:
                        from zeus.monitor import ZeusMonitor

                        # A window of a small model's steps can end before NVML's energy counter moves (an
                        # H200 read 0 J for 18 steps of the digits' MLP, and zeus refused the measurement):
                        # zeus then takes power x time, as the energy meter does.
                        monitor = ZeusMonitor(gpu_indices=[gpu_index], cpu_indices=[], approx_instant_energy=True)
                    if list(monitor.gpu_indices) != [gpu_index]:
                        raise InputError(f"monitor watches GPUs {monitor.gpu_indices}; it must watch [{gpu_index}]")
                    self._optimizer = zpl.GlobalPowerLimitOptimizer(
                        monitor,
                        optimum_selector=zpl.ZeusCost(eta, world_size),
                        wait_steps=wait_steps,
                        warmup_steps=warmup_steps,
                        profile_steps=profile_steps,
                        pl_step=pl_step_w,
                    )
                else:
                    self._gpus.set_power_management_limit(gpu_index, self._chosen_mw)
        except BaseException:
            self.close()
            raise

    def step_begin(self) -> None:
        """Call at the start of every training step (zeus's ``on_step_begin``); a no-op unless ``"auto"``."""
        if self._optimizer is not None and not self._closed:
            with _privileged():
                self._optimizer.on_step_begin()

    def epoch_end(self) -> None:
        """Call at the end of every epoch (zeus's ``on_epoch_end``: a cut profiling window is retried later)."""
        if self._optimizer is not None and not self._closed:
            with _privileged():
                self._optimizer.on_epoch_end()

    @property
    def chosen(self) -> int | None:
        """The limit (W) this run keeps: known at once for ``"max"`` or watts, after profiling for ``"auto"``."""
        if self._optimizer is None:
            return None if self._chosen_mw is None else self._chosen_mw // 1000
        state = self._optimizer.state
        return state.optimal_power_limit // 1000 if type(state).__name__ == "Done" else None

    @property
    def candidates(self) -> int:
        """How many limits ``"auto"`` profiles (1 for a fixed limit)."""
        return 1 if self._optimizer is None else len(self._optimizer.power_limits)

    @property
    def profile(self) -> list[ProfiledLimit]:
        """``"auto"``'s measurements so far, one per profiled limit in the order profiled (empty otherwise)."""
        found = [] if self._optimizer is None else self._optimizer.measurements
        return [ProfiledLimit(int(m.power_limit), float(m.time), float(m.energy)) for m in found]

    @property
    def original_w(self) -> float:
        """This GPU's power limit (W) before this object changed it: what ``close()`` restores."""
        return float(self._original_mw[self.gpu_index]) / 1000

    def close(self) -> None:
        """Put back the recorded limits (and persistence mode); stop changing them. Safe to call again."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(ValueError):  # outside the main thread: the handler could not be installed
                if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
                    signal.signal(signal.SIGTERM, self._previous_sigterm)
            if self._optimizer is not None:
                # zeus's atexit callback sets the maximum unless it believes the maximum is already set.
                self._optimizer.current_power_limit = max(self._optimizer.power_limits)
            else:  # no zeus callback to outlast: our own atexit hook is no longer needed
                atexit.unregister(self._at_exit)
        self._restore()

    def _restore(self) -> None:
        for index, mw in self._original_mw.items():
            try:
                if self._gpus.get_power_management_limit(index) != mw:
                    self._gpus.set_power_management_limit(index, mw)
            except Exception as err:  # restoring must not hide the error that ended the run
                log.warning("could not restore GPU %d's power limit to %g W: %s", index, mw / 1000, err)
        for index, enabled in self._original_persistence.items():
            try:
                if self._gpus.get_persistence_mode(index) != enabled:
                    self._gpus.set_persistence_mode(index, enabled)
            except Exception as err:
                log.warning("could not restore GPU %d's persistence mode to %s: %s", index, enabled, err)

    def _at_exit(self) -> None:
        self.close()

    def _install_sigterm(self) -> None:
        try:
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: exceptions, close() and atexit still restore
            log.debug("SIGTERM handler not installed: not in the main thread")

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_sigterm
        self.close()  # restores, and puts the previous handler back
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # SIG_DFL, or None (set outside Python): terminate as if never caught
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def __enter__(self) -> PowerLimits:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()
