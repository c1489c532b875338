"""Routing by message: a stage learns which replica sent a microbatch from the microbatch's announcement.

With reassignment, which replica of a stage runs a microbatch is decided at run time by its claims, so the
next stage cannot know ahead of time whom to receive from, nor whom to send the gradient back to. Each
send is announced through the c10d store, on a queue per step and stage boundary: the sender appends
``chunk,count,sender`` (``add`` gives it the next place, ``set`` fills it) and the receiver reads the places
in order (``get`` waits for the next one), then receives the payload from that sender over
:class:`~conveyor.runtime.P2P`. A sender's payloads arrive in the order of its announcements (messages
between two workers stay in order), and the gradient goes back to the sender the announcement named: the
backward runs on the replica that ran the forward. The store, not the backend, carries the routing, so the
backend never receives from an unknown source (which NCCL cannot).

Each queue has one reader (a later stage has one worker), which deletes each place once it has read it and
the queue's counter with its last place (or the run's end): once the last is set, every sender's ``add`` is
done, so the store holds no keys of steps read, however long the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from conveyor.runtime import P2P, differentiable_leaves

__all__ = ["Arrival", "Router"]

END = -1  # the chunk index of the announcement that ends a run (for stages that read no batches)


@dataclass
class Arrival:
    """A microbatch received from the previous stage."""

    chunk: int  # its index among the batch's chunks (which targets it takes)
    count: int  # how many non-empty chunks the batch has
    sender: int  # the rank that ran its forward, which takes its gradient back
    inputs: Any = None  # the activations (their floating tensors require gradients when training)


class Router:
    """Sends microbatches to the next stage and gradients back, announcing each send in the store.

    Args:
        store: the job's c10d store.
        device: where received tensors go.
    """

    def __init__(self, store: dist.Store, device: torch.device) -> None:
        self.store, self.p2p, self.rank = store, P2P(device), dist.get_rank()

    def send(self, queue: str, tree: Any, chunk: int, count: int, dst: int) -> None:
        """Announce on ``queue`` and send ``tree`` (chunk ``chunk`` of a batch of ``count``) to rank ``dst``."""
        if chunk != END:
            self.p2p.send_tree(tree, dst)  # queued before it is announced, so a reader never waits on it long
        place = int(self.store.add(f"{queue}/size", 1))
        self.store.set(f"{queue}/{place}", f"{chunk},{count},{self.rank}")

    def end(self, queue: str) -> None:
        """Announce on ``queue`` that the run has no more batches."""
        self.send(queue, None, END, 0, -1)

    def receive(self, queue: str, place: int, training: bool = True) -> Arrival:
        """The microbatch announced at ``place`` (1, 2, ...) on ``queue``, waiting for it; its ``chunk`` is
        :data:`END` at a run's end. The caller reads every place in order, each once (they are deleted)."""
        chunk, count, sender = (int(v) for v in self.store.get(f"{queue}/{place}").decode().split(","))
        self.store.delete_key(f"{queue}/{place}")
        if chunk == END or place == count:
            self.store.delete_key(f"{queue}/size")
        arrival = Arrival(chunk, count, sender)
        if chunk != END:
            arrival.inputs, _ = self.p2p.recv_tree(sender)
            if training:
                for t in differentiable_leaves(arrival.inputs):
                    t.requires_grad_(True)
        return arrival

    def send_grads(self, arrival: Arrival) -> None:
        """Send the gradient of ``arrival``'s inputs back to the replica that sent them."""
        leaves = differentiable_leaves(arrival.inputs)
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves]
        self.p2p.send_tensors(grads, arrival.sender)

    def backward(self, outputs: Any, src: int) -> None:
        """Receive from rank ``src`` the gradient of ``outputs`` (sent on) and back-propagate it."""
        leaves = differentiable_leaves(outputs)
        grads = self.p2p.recv_tensors(leaves, src)
        pairs = [(out, g) for out, g in zip(leaves, grads, strict=True) if out.requires_grad]
        if pairs:  # a stage with no parameters fed by raw data has nothing to differentiate
            torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])

    def wait_sends(self) -> None:
        """Block until every payload sent so far has left."""
        self.p2p.wait_sends()
