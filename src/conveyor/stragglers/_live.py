"""Live reduction: a step's gradient is summed from its chunks' own gradients, each sent by the replica whose run
of the chunk was used, so a step needs only the replicas that ran its chunks, never one that is stalled.

An all-reduce needs every replica: a frozen one holds up the step until it thaws, whatever reassignment and
backups did with its chunks. Here each run of a chunk on the first stage keeps its own buffer ``b_c``: the
chunk's gradient sum, its BatchNorm statistics, its loss sum, its sample count and its run's seconds. The run
that commits the chunk (:mod:`conveyor.stragglers._backup`: a ``compare_set`` of ``by/c`` to ``"r,k"``, the
replica and its ``k``-th commit of the step) sends ``b_c`` at once to every other replica of the stage, point
to point over c10d. Every replica waits until each of the step's chunks is committed (backing up those held
past a deadline), receives the buffers from their runners (each sender's in the order it sent them, ``k``),
and sums them in chunk order:

    B(t) = b_0 + b_1 + ... + b_(C-1)

the same numbers added in the same order on every replica, so all hold bitwise the same ``B(t)``, from which the
update is the all-reduce's (:mod:`conveyor.stragglers._trainer`): the batch's mean gradient ``sum(n_c grad
l_c) / sum(n_c)``, the statistics' rule, the loss.

Gloo's point-to-point messages are a rendezvous: a send moves only once its receiver has posted the receive, by
the sender's threads, so a sender frozen after its commit would hold its buffer back until it thawed. Every
replica therefore keeps receives posted for each peer at all times, as many as a step has chunks (a peer
can commit them all): a commit's send then leaves at once, whatever the sender does next. The cost is that
memory: ``C (N - 1)`` buffers of a gradient's size a replica.

A replica frozen through a step runs none of its chunks (its peers take its share from the tail and back up
the chunk it holds), so nobody waits for it. What its peers send it waits in the transport; when it thaws, the
run it was in is refused at its commit (or stops at its next look), it finds each step's chunks taken and
committed, and applies the steps it missed from the buffers it receives, in order: bitwise its peers' updates,
optimizer state included, so it rejoins with their weights without copying them.

What it costs: each replica sends each chunk it commits to every peer, so with ``C`` chunks among ``N``
replicas a replica sends and receives about ``C (N - 1) / N`` gradients a step, against ``2 (N - 1) / N`` for a
ring all-reduce: ``C / 2`` times the bytes (with 2 chunks a replica, ``C = 2N``: ``N`` times). A model whose
gradient takes long to send on the network it has pays that every step.

A step's store keys (the claims' counters, ``by/c``, ``backup/c``) are deleted by the last replica to apply
the step (a counter ``applied``), which in a pipeline also tells the next stage the step is released.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from conveyor.runtime.parts import P2P, PendingRecv
from conveyor.stragglers._buffer import BufferLayout

__all__ = ["LiveReduction", "Runner"]

Runner = tuple[int, int]  # the replica whose run of a chunk was used, and its place among that replica's sends
Sends = list[tuple[dist.Work, torch.Tensor]]


def parse_runner(name: str) -> Runner:
    """``"r,k"`` as ``(r, k)``.

    Example:
        >>> parse_runner("2,0")
        (2, 0)
    """
    replica, place = name.split(",")
    return int(replica), int(place)


class LiveReduction:
    """One replica's side of live reduction among a stage's replicas.

    Args:
        store: the job's c10d store.
        device: where chunk buffers are received.
        replica: this replica.
        ranks: each replica's global rank, in replica order.
        tag: its messages' tag (apart from any other point-to-point messages between the same workers).
    """

    def __init__(
        self, store: dist.Store, device: torch.device, *, replica: int, ranks: Sequence[int], tag: int
    ) -> None:
        self.store, self.replica, self.ranks = store, replica, list(ranks)
        self.p2p = P2P(device, tag=tag)
        self._own: dict[int, torch.Tensor] = {}  # this step's committed buffers, by chunk
        self._sends: dict[str, Sends] = {}  # per step, sends whose receivers may not have read them yet
        self._posted: dict[int, deque[PendingRecv]] = {}  # per peer, receives posted for its next buffers
        self._like: torch.Tensor | None = None

    def open(self, like: torch.Tensor, chunks: int) -> None:
        """Post ``chunks`` receives of a buffer shaped ``like`` for each peer (once: they stay posted, each read
        one replaced by another)."""
        if self._like is not None:
            return
        self._like = like
        for replica, rank in enumerate(self.ranks):
            if replica != self.replica:
                self._posted[replica] = deque(self.p2p.irecv_tensors([like], rank) for _ in range(chunks))

    def name(self) -> str:
        """The name of this replica's next commit in the step: ``"r,k"``."""
        return f"{self.replica},{len(self._own)}"

    def deliver(self, chunk: int, buffer: torch.Tensor, step_key: str) -> None:
        """Chunk ``chunk``'s run here was committed: send its buffer to every peer, keep it for the sum."""
        self._own[chunk] = buffer
        peers = [rank for r, rank in enumerate(self.ranks) if r != self.replica]
        self._sends.setdefault(step_key, []).extend(self.p2p.isend_tensors([buffer], peers))

    def collect(self, runners: dict[int, Runner]) -> list[torch.Tensor]:
        """Every chunk's buffer, in the order of ``runners`` (chunk -> who committed it): this replica's own, the
        others read from their runners in the order each sent them."""
        assert self._like is not None, "collect() before open()"
        places: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for chunk, (replica, place) in runners.items():
            places[replica].append((place, chunk))
        buffers = dict(self._own)
        for replica, sent in places.items():
            if replica == self.replica:
                continue
            posted = self._posted[replica]
            for _, chunk in sorted(sent):
                (buffers[chunk],) = self.p2p.wait_tensors(posted.popleft())
                posted.append(self.p2p.irecv_tensors([self._like], self.ranks[replica]))
        self._own = {}
        return [buffers[chunk] for chunk in runners]

    def reduce(
        self, runners: dict[int, Runner], replicas: int, layout: BufferLayout
    ) -> tuple[torch.Tensor, list[float]]:
        """The step's sum (module docstring) from ``runners`` (chunk -> who committed it, in chunk order), and
        each replica's samples a second over its runs that were used (0 where it ran none)."""
        buffers = self.collect(runners)
        total = buffers[0].clone()
        for buffer in buffers[1:]:  # in chunk order, as every replica adds them: bitwise the same sum
            total += buffer
        parts = [layout.read(b) for b in buffers]  # a chunk's extra is its run's seconds
        samples, seconds = torch.stack([torch.stack([p.samples, p.extra[0]]) for p in parts]).T.tolist()
        busy, ran = [0.0] * replicas, [0.0] * replicas
        for (replica, _), n, s in zip(runners.values(), samples, seconds, strict=True):
            busy[replica], ran[replica] = busy[replica] + s, ran[replica] + n
        return total, [n / s if s > 0 else 0.0 for n, s in zip(ran, busy, strict=True)]

    def applied(self, step_key: str, keys: Sequence[str], on_last: Callable[[], None]) -> None:
        """This replica applied the step of ``step_key``. The last of the replicas to do so deletes ``keys`` (the
        step's) and calls ``on_last``; sends of steps every replica has applied are waited on (at once: read)."""
        if int(self.store.add(f"{step_key}/applied", 1)) == len(self.ranks):
            for key in (*keys, f"{step_key}/applied"):
                self.store.delete_key(key)
            on_last()
        for key in [k for k in self._sends if k != step_key]:  # the run's last steps' wait for the next run's
            if not self.store.check([f"{key}/applied"]):  # deleted: every replica applied it
                self._wait(key)

    def _wait(self, step_key: str) -> None:
        for work, _ in self._sends.pop(step_key):
            work.wait()
