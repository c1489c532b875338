"""Network namespaces held by open file descriptors, so they vanish with the processes that hold them.

A namespace made by ``ip netns add`` is pinned by a mount and outlives a killed job. These are not: the
launcher holds each one by a descriptor and the workers by living in it, so when the last of them exits
(SIGKILL included) the kernel deletes the namespace with every link in it.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading

__all__ = ["Namespace", "enter_namespace"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_namespace(path: str) -> None:
    """Move the calling thread into the network namespace at ``path`` (a ``/proc/PID/fd/N`` link)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, _CLONE_NEWNET), f"cannot enter network namespace {path}")
    finally:
        os.close(fd)


class Namespace:
    """A new, empty network namespace (only ``lo``, down), alive while this object or a process in it is."""

    def __init__(self) -> None:
        fds: list[int] = []

        def create() -> None:  # in a thread of its own: unshare moves only the calling thread
            _check(_libc.unshare(_CLONE_NEWNET), "cannot create a network namespace")
            fds.append(os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY))

        thread = threading.Thread(target=create)
        thread.start()
        thread.join()
        if not fds:
            raise OSError("cannot create a network namespace (needs CAP_SYS_ADMIN: run as root)")
        self.fd = fds[0]

    @property
    def path(self) -> str:
        """A path other processes (``ip ... netns PATH``, :func:`enter_namespace`) can open it by."""
        return f"/proc/{os.getpid()}/fd/{self.fd}"

    def run(self, *command: str, stdin: str | None = None) -> str:
        """Run ``command`` inside the namespace; return its output, or raise with its error message."""
        done = subprocess.run(command, input=stdin, text=True, capture_output=True, preexec_fn=self._enter, check=False)
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} failed: {done.stderr.strip()}")
        return done.stdout

    def batch(self, tool: str, lines: list[str]) -> None:
        """Run many ``ip`` or ``tc`` commands inside the namespace in one process."""
        if lines:
            self.run(tool, "-batch", "-", stdin="\n".join(lines) + "\n")

    def _enter(self) -> None:
        _check(_libc.setns(self.fd, _CLONE_NEWNET), "cannot enter network namespace")

    def close(self) -> None:
        """Let go of the namespace; the kernel deletes it once no process lives in it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
