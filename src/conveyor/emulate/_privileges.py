"""What emulation needs from the machine, checked before any worker starts, with one line per problem."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from conveyor.emulate._cgroups import CgroupError, cgroup_roots
from conveyor.emulate._netns import Namespace

__all__ = ["EmulationError", "require_cgroups", "require_netem", "require_network"]

_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21


class EmulationError(OSError):
    """The emulated cluster cannot be set up here; the message says what is missing."""


def _capabilities() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def require_network() -> None:
    """Network emulation needs CAP_NET_ADMIN and CAP_SYS_ADMIN (namespaces), the ``ip`` and ``tc`` tools (iproute2)
    and ``nsenter`` (util-linux, to read the links' counters)."""
    caps = _capabilities()
    missing = [
        name
        for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
        if not caps >> bit & 1
    ]
    if missing:
        raise EmulationError(f"--network needs {' and '.join(missing)} (run as root) to make namespaces and links")
    tools = [tool for tool in ("ip", "tc", "nsenter") if shutil.which(tool) is None]
    if tools:
        raise EmulationError(
            f"--network needs iproute2's ip and tc and util-linux's nsenter, and {' and '.join(tools)} is not on PATH"
        )


def require_netem() -> None:
    """Latency needs the kernel's ``netem`` queueing discipline."""
    ns = Namespace()
    try:
        ns.run("tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
    except OSError as exc:
        raise EmulationError(
            "this kernel has no netem queueing discipline (CONFIG_NET_SCH_NETEM), so link latency cannot be "
            "emulated: drop the /LATENCY parts of --network"
        ) from exc
    finally:
        ns.close()


def require_cgroups() -> None:
    """Device speeds and faults need a writable cgroup CPU controller (and a freezer)."""
    try:
        roots = cgroup_roots()
    except CgroupError as exc:
        raise EmulationError(str(exc)) from None
    for root in roots:
        parent = root if root.is_dir() else root.parent
        if not os.access(parent, os.W_OK):
            raise EmulationError(f"--devices and --faults need write access to {parent} (run as root)")
