"""Worker compute speeds, as CPU cores each worker may use: ``1,1,0.5,0.5`` or ``fast=1.0:2,slow=0.25:2``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from conveyor.errors import InputError

__all__ = ["EmulatedDevice", "parse_devices"]


@dataclass(frozen=True)
class EmulatedDevice:
    """One worker's emulated device: a name (its type) and the CPU cores it may use."""

    name: str
    cores: float


def parse_devices(text: str, workers: int) -> tuple[EmulatedDevice, ...]:
    """Read ``--devices`` for a job of ``workers`` workers.

    Either one core count per worker (``1,1,0.5,0.5``; a single number applies to every worker) or named
    types with counts, in rank order (``fast=1.0:2,slow=0.25:2``: ranks 0-1 fast, 2-3 slow).

    Example:
        >>> parse_devices("fast=1:1,slow=0.25:1", 2)
        (EmulatedDevice(name='fast', cores=1.0), EmulatedDevice(name='slow', cores=0.25))
        >>> [d.cores for d in parse_devices("0.5", 3)]
        [0.5, 0.5, 0.5]
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise InputError("--devices is empty: give cores per worker (1,1,0.5,0.5) or types (fast=1.0:2,slow=0.25:2)")
    devices: list[EmulatedDevice] = []
    for part in parts:
        name, named, spec = part.rpartition("=")
        cores_text, _, count_text = spec.partition(":") if named else (spec, "", "1")
        try:
            cores, count = float(cores_text), int(count_text)
        except ValueError:
            raise InputError(
                f"cannot read device {part!r} of --devices {text!r}: write CORES per worker (0.5) or "
                "NAME=CORES:COUNT (slow=0.25:2)"
            ) from None
        if not (cores > 0 and math.isfinite(cores)) or count < 1:
            raise InputError(f"device {part!r} needs cores > 0 and a count >= 1")
        devices += [EmulatedDevice(name if named else f"{cores:g}-core", cores)] * count
    if len(devices) == 1:
        devices *= workers
    if len(devices) != workers:
        raise InputError(f"--devices {text!r} describes {len(devices)} workers but the job has {workers}")
    return tuple(devices)
