"""Rapid reassignment: a step's chunks as claimable work, each claimed exactly once through the c10d store.

A step's batch is cut into chunks; replica ``w`` owns a contiguous share of ``shares[w]`` of them, after
those of the replicas before it (equal shares, or shares weighted by measured speed:
:mod:`conveyor.stragglers._shares`). The owner works through its share from the head; a replica with no
own work left takes chunks from the *tail* of the peer with the most unclaimed ones, one at a time, so
owner and helpers meet in the middle and the slow replica keeps only what it can finish.

One store key per share and step, ``share/w``, counts both ends in one integer, ``head + tail * 2**20``,
and every claim is one atomic ``add`` to it (``add`` never waits, unlike ``get``): the owner adds 1, a
helper ``2**20``. The value ``add`` returns says what the claim got: the owner's claim is the share's chunk
``head - 1`` and a helper's its chunk ``shares[w] - tail``, each valid only while ``head + tail <=
shares[w]``. The store orders the adds, and each valid one takes the next chunk from its end of what is
left, so no chunk runs twice and none is skipped however the claims race. The same counter is the owner's
progress report: a helper reads every peer's (``add`` of 0) and takes from the one with the most left. A
replica is done with a step once its own share and every peer's counter show nothing left.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch.distributed as dist

from conveyor.errors import InputError

__all__ = ["Claim", "StepClaims", "share_keys"]


Claim = tuple[int, bool]  # (chunk index in the batch, whether it was taken from a peer's share)
_TAIL = 2**20  # a helper's unit in a share's counter (the owner's is 1), so a share has fewer chunks


class StepClaims:
    """The claims of one replica in one step.

    Args:
        store: the job's c10d store.
        prefix: keys of this step (unique per pipeline, run and step).
        replica: this replica.
        shares: chunks each replica owns, in replica order (a share may be empty).
        reassign: take chunks from slow peers; ``False`` runs exactly the own share (a fixed split).

    Example (single process, a dict-backed store):
        >>> store = dist.HashStore()
        >>> # replica 0's share, then all of replica 1's
        >>> [c for c in StepClaims(store, "s0", replica=0, shares=[2, 2])]
        [(0, False), (1, False), (3, True), (2, True)]
        >>> [c for c in StepClaims(store, "s0", replica=1, shares=[2, 2])]  # nothing left for replica 1
        []
        >>> [c for c in StepClaims(store, "s1", replica=1, shares=[3, 1])]  # a slow replica 0 owns more
        [(3, False), (2, True), (1, True), (0, True)]
    """

    def __init__(
        self, store: dist.Store, prefix: str, *, replica: int, shares: Sequence[int], reassign: bool = True
    ) -> None:
        if not all(0 <= n < _TAIL - 1 for n in shares) or not sum(shares):  # the owner's last, refused
            # claim must not carry into the tail count
            raise InputError(f"each replica's share has 0 to {_TAIL - 2} chunks and some one, got {list(shares)}")
        self.store, self.prefix, self.replica, self.reassign = store, prefix, replica, reassign
        self.shares = list(shares)
        self.starts = [sum(self.shares[:w]) for w in range(len(self.shares))]  # each share's first chunk

    def __iter__(self) -> Iterator[Claim]:
        """The chunks this replica runs, in order, each claimed just before it is run."""
        while (j := self._own()) is not None:
            yield j, False
        while self.reassign and (j := self._help()) is not None:
            yield j, True

    def _add(self, owner: int, amount: int) -> tuple[int, int]:
        """Add ``amount`` to ``owner``'s counter; its head and tail counts after the add."""
        value = int(self.store.add(_share_key(self.prefix, owner), amount))
        return value % _TAIL, value // _TAIL

    def _own(self) -> int | None:
        """The next chunk of the own share, or ``None`` once it is exhausted (to the end, or met a helper)."""
        head, tail = self._add(self.replica, 1)
        return self.starts[self.replica] + head - 1 if head + tail <= self.shares[self.replica] else None

    def left(self, owner: int) -> int:
        """Chunks of ``owner``'s share nobody has claimed yet, by its counter (never waits)."""
        head, tail = self._add(owner, 0)
        return self.shares[owner] - head - tail

    def _help(self) -> int | None:
        """A chunk from the tail of the peer with the most left, or ``None`` once no peer has any."""
        while True:
            peers = [p for p in range(len(self.shares)) if p != self.replica]
            left = {p: self.left(p) for p in peers}
            if not left or max(left.values()) <= 0:
                return None
            victim = max(peers, key=lambda p: (left[p], -p))
            head, tail = self._add(victim, _TAIL)
            if head + tail <= self.shares[victim]:
                return self.starts[victim] + self.shares[victim] - tail


def _share_key(prefix: str, owner: int) -> str:
    return f"{prefix}/share/{owner}"


def share_keys(prefix: str, replicas: int) -> list[str]:
    """The claim counters of the step of ``prefix``, in replica order: each deleted once every replica is past
    that step (no claim on its share can come), so the store does not grow with the steps."""
    return [_share_key(prefix, owner) for owner in range(replicas)]
