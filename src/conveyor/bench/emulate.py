"""``conveyor bench emulate``: does the emulated cluster deliver what it is told to?

Measures two-worker links shaped to 10 Mbit/s, 100 Mbit/s, 1 Gbit/s and 10 Gbit/s (and an unshaped one:
what this machine can carry at all), the time of a small message, the compute rate of workers under CPU
quotas, and the time to set up and tear down clusters of 4 and 16 workers. Goal: links and quotas within
10% of their spec (where the machine can carry the rate), set-up and tear-down under 5 s.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from conveyor.emulate import Cluster, Emulation, EmulationError, check_cluster
from conveyor.emulate.parts import require_netem
from conveyor.errors import InputError

__all__ = ["EmulateBenchConfig", "run"]

RATES = {"10 Mbit/s": 1.25e6, "100 Mbit/s": 1.25e7, "1 Gbit/s": 1.25e8, "10 Gbit/s": 1.25e9}
_UNSHAPED = 1e12  # far above what a machine's loopback carries: measures the machine's ceiling


@dataclass(frozen=True)
class EmulateBenchConfig:
    """What ``conveyor bench emulate`` measures."""

    devices: str = "1,0.5,0.25,0.1"
    seconds_per_link: float = 2.0
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.seconds_per_link <= 0 or self.repeats < 1:
            raise InputError("seconds_per_link must be > 0 and repeats >= 1")


def _setup_teardown(network: str, devices: str, workers: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="conveyor-bench-emulate-") as tmp:
        start = time.perf_counter()
        with Cluster(Emulation(network=network, devices=devices), workers, Path(tmp)):
            built = time.perf_counter()
        return {
            "workers": workers,
            "network": network,
            "setup_s": built - start,
            "teardown_s": time.perf_counter() - built,
        }


def run(cfg: EmulateBenchConfig) -> dict[str, Any]:
    """Measure everything; return the JSON-ready report."""
    links = []
    for name, rate in [*RATES.items(), ("unshaped", _UNSHAPED)]:
        for repeat in range(cfg.repeats):
            report = check_cluster(Emulation(network=f"2:{rate:g}"), 2, cfg.seconds_per_link, speeds=False)
            for link in report["links"]:
                links.append({"rate": name, "repeat": repeat, **link})
    ceiling = max(link["measured_bytes_per_s"] for link in links if link["rate"] == "unshaped")
    for link in links:
        shaped = link["rate"] != "unshaped"
        link["error"] = link["measured_bytes_per_s"] / link["spec_bytes_per_s"] - 1 if shaped else None
        link["above_ceiling"] = link["spec_bytes_per_s"] > ceiling
    workers = len(cfg.devices.split(","))
    devices = []
    for repeat in range(cfg.repeats):
        for row in check_cluster(Emulation(devices=cfg.devices), workers)["devices"]:
            devices.append({"repeat": repeat, **row, "error": row["measured_cores"] / row["spec_cores"] - 1})
    try:
        require_netem()
        latency = "emulated with netem"
    except EmulationError as exc:
        latency = f"not emulated: {exc}"
    setup = [_setup_teardown("2:1.25e9,2:1.25e7", "0.5", 4), _setup_teardown("4:1.25e9,4:1.25e7", "0.1", 16)]
    return {
        "config": asdict(cfg),
        "ceiling_bytes_per_s": ceiling,
        "latency": latency,
        "links": links,
        "devices": devices,
        "setup": setup,
    }
