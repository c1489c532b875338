"""The emulated cluster's parts that the other systems build on: the fault driver a launcher runs, a server's
traffic counters, the busy loop a straggler or a co-located job runs and its calibration, and the check for
``tc``'s delay. Not the public API (:mod:`conveyor.emulate` is)."""

from conveyor.emulate._check import cpu_loop_seconds
from conveyor.emulate._driver import BUSY_LOOP, FaultDriver
from conveyor.emulate._network import ServerTraffic
from conveyor.emulate._privileges import require_netem

__all__ = ["BUSY_LOOP", "FaultDriver", "ServerTraffic", "cpu_loop_seconds", "require_netem"]
