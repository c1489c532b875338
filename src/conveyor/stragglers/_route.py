"""Routing by message: a stage learns which replica sent a microbatch from the microbatch's announcement.

With reassignment, which replica of a stage runs a microbatch is decided at run time by its claims, so the
next stage cannot know ahead of time whom to receive from, nor whom to send the gradient back to. Each
send is announced through the c10d store, on one queue per run and receiving stage: the sender appends
``kind,step,chunk,count,sender,start`` (``add`` gives it the next place, ``set`` fills it) and the receiver reads
the places in order (``get`` waits for the next one), then receives the payload from that sender over
:class:`~conveyor.runtime.parts.P2P`. A sender's payloads arrive in the order of its announcements (messages
between two workers stay in order), and the gradient goes back to the sender the announcement named: the
backward runs on the replica that ran the forward. The store, not the backend, carries the routing, so the
backend never receives from an unknown source (which NCCL cannot).

Kinds: :data:`FORWARD` (a chunk's activations; a backup's run of a chunk already received is announced the
same way, and the receiver tells them apart), :data:`RELEASE` (every replica of the first stage is past a
step: nothing of it comes again) and :data:`END` (the run has no more steps).

Each queue has one reader (a later stage has one worker), which deletes each place once it has read it and
the queue's counter once it read the run's end: every sender's ``add`` is done by then, so the store holds no
keys of steps read, however long the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.runtime import differentiable_leaves
from conveyor.runtime.parts import P2P

__all__ = ["END", "FORWARD", "RELEASE", "Entry", "Router"]

FORWARD, RELEASE, END = "F", "R", "E"


@dataclass
class Entry:
    """A place of a queue: a chunk sent on (its payload received by :meth:`Router.receive`), or a notice."""

    kind: str  # FORWARD, RELEASE or END
    step: int  # the run's step it belongs to (0, 1, ...)
    chunk: int = 0  # its index among the batch's chunks (which targets it takes)
    count: int = 0  # how many non-empty chunks the batch has
    sender: int = -1  # the rank that ran its forward, which takes its gradient back
    start: int = 0  # its first sample's place in the batch (the chunks' sizes follow the replicas' speeds)
    inputs: Any = None  # the activations once received (their floating tensors require gradients when training)


class Router:
    """Sends microbatches to the next stage and gradients back, announcing each send in the store.

    Args:
        store: the job's c10d store.
        device: where received tensors go.
    """

    def __init__(self, store: dist.Store, device: torch.device) -> None:
        self.store, self.p2p, self.rank = store, P2P(device), dist.get_rank()
        self._read: dict[str, int] = {}  # each queue's last place read here

    def send(self, queue: str, tree: Any, *, step: int, chunk: int, count: int, start: int, dst: int) -> None:
        """Announce on ``queue`` and send ``tree`` (chunk ``chunk`` of ``count`` in ``step``, from sample ``start``)
        to rank ``dst``."""
        self.p2p.send_tree(tree, dst)  # queued before it is announced, so a reader never waits on it long
        self._announce(queue, f"{FORWARD},{step},{chunk},{count},{self.rank},{start}")

    def notify(self, queue: str, kind: str, step: int = 0) -> None:
        """Announce on ``queue`` that ``step`` is released (:data:`RELEASE`) or the run ended (:data:`END`)."""
        self._announce(queue, f"{kind},{step},0,0,-1,0")

    def _announce(self, queue: str, text: str) -> None:
        place = int(self.store.add(f"{queue}/size", 1))
        self.store.set(f"{queue}/{place}", text)

    def next(self, queue: str) -> Entry:
        """The next place of ``queue``, waiting for it (the payload of a chunk is not received yet: see
        :meth:`receive`). Each place is read once, here, and deleted."""
        place = self._read.get(queue, 0) + 1
        kind, *fields = self.store.get(f"{queue}/{place}").decode().split(",")
        self.store.delete_key(f"{queue}/{place}")
        self._read[queue] = place
        step, chunk, count, sender, start = (int(v) for v in fields)
        return Entry(kind, step, chunk, count, sender, start)

    def close(self, queue: str) -> None:
        """Delete ``queue``'s counter, once its last place is read (nobody announces on it again)."""
        self.store.delete_key(f"{queue}/size")
        self._read.pop(queue, None)

    def receive(self, entry: Entry, training: bool = True) -> Entry:
        """Receive ``entry``'s payload from its sender (a sender's payloads in the order it announced them)."""
        entry.inputs, _ = self.p2p.recv_tree(entry.sender)
        if training:
            for t in differentiable_leaves(entry.inputs):
                t.requires_grad_(True)
        return entry

    def input_grads(self, entry: Entry) -> list[torch.Tensor]:
        """The gradients of ``entry``'s inputs after its backward (zeros where one has none)."""
        return [t.grad if t.grad is not None else torch.zeros_like(t) for t in differentiable_leaves(entry.inputs)]

    def send_grads(self, grads: list[torch.Tensor], dst: int) -> None:
        """Send the gradients of inputs that rank ``dst`` sent back to it."""
        self.p2p.send_tensors(grads, dst)

    def backward(self, outputs: Any, src: int, *, run: bool = True) -> None:
        """Receive from rank ``src`` the gradient of ``outputs`` (sent on) and back-propagate it (``run=False``:
        receive it only, for a run a peer's replaced)."""
        leaves = differentiable_leaves(outputs)
        grads = self.p2p.recv_tensors(leaves, src)
        pairs = [(out, g) for out, g in zip(leaves, grads, strict=True) if out.requires_grad]
        if pairs and run:  # a stage with no parameters fed by raw data has nothing to differentiate
            torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])

    def wait_sends(self) -> None:
        """Block until every payload sent so far has left."""
        self.p2p.wait_sends()
