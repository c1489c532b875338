"""Actions: the steps of one worker's program (``F3``, ``SEND_F3>1``, ``B3``, ``REDUCE``, ``STEP``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from conveyor.errors import InputError

__all__ = ["Action", "Op"]


class Op(StrEnum):
    """What an action does."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACTIVATION = "SEND_F"
    RECV_ACTIVATION = "RECV_F"
    SEND_GRAD = "SEND_B"
    RECV_GRAD = "RECV_B"
    REDUCE_GRAD = "REDUCE"
    STEP = "STEP"

    @property
    def is_send(self) -> bool:
        return self in (Op.SEND_ACTIVATION, Op.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Op.RECV_ACTIVATION, Op.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One step of one worker's program.

    ``REDUCE`` turns the gradients summed over the samples of an update into their mean: it all-reduces them
    (with the sample count) among the replicas of the worker's stage and divides by the samples. ``STEP``
    then clips the gradients, steps the optimizer and makes the result the newest weight version.

    Attributes:
        op: what to do.
        microbatch: the microbatch it concerns (``None`` for ``REDUCE`` and ``STEP``).
        peer: for sends and receives, the worker on the other end.
        version: for a forward, the weight version it must use (the number of optimizer steps this
            worker had taken when that version was current); ``None`` means the newest. The backward
            of a microbatch always uses the version of its forward.

    Example:
        >>> str(Action(Op.SEND_ACTIVATION, 3, peer=1)), Action.parse("F5@1")
        ('SEND_F3>1', Action(op=<Op.FORWARD: 'F'>, microbatch=5, peer=None, version=1))
    """

    op: Op
    microbatch: int | None = None
    peer: int | None = None
    version: int | None = None

    @property
    def mb(self) -> int:
        """The microbatch of an action that concerns one (all but ``REDUCE`` and ``STEP``)."""
        if self.microbatch is None:
            raise InputError(f"{self} concerns no microbatch")
        return self.microbatch

    @property
    def to(self) -> int:
        """The worker on the other end of a send or receive."""
        if self.peer is None:
            raise InputError(f"{self} has no peer")
        return self.peer

    def __str__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        version = "" if self.version is None else f"@{self.version}"
        if self.peer is None:
            return f"{self.op.value}{mb}{version}"
        return f"{self.op.value}{mb}{'>' if self.op.is_send else '<'}{self.peer}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``"SEND_F3>1"`` -> ``Action(Op.SEND_ACTIVATION, 3, 1)``, ``"F4@2"`` -> version 2."""
        for op in sorted(Op, key=lambda o: -len(o.value)):
            if text.startswith(op.value):
                rest, _, version = text[len(op.value) :].partition("@")
                mb, _, peer = rest.replace("<", ">").partition(">")
                try:
                    return cls(op, _number(mb), _number(peer), _number(version))
                except ValueError:
                    break
        raise InputError(f"cannot parse action {text!r}; expected e.g. 'F0', 'F5@1', 'RECV_B2<1', 'REDUCE', 'STEP'")


def _number(text: str) -> int | None:
    return int(text) if text else None
