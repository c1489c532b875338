"""What the sites' leaders send each other over the WAN, and how a site's replicas learn it over the LAN.

A sparse exchange (Gaia) is two rounds among the leaders: the **notice**, one all-gather of each site's entry count
and payload size (16 bytes a site: who is about to send significant updates, and how much), then the **payloads**,
sent point to point only by the sites that announced some, each received only from those (the selective barrier: a
site waits for the updates announced, not for every site's clock). A leader's :class:`Courier` runs its exchanges,
one per exchanging update (every ``period`` updates), in order, on a thread of its own, so that an exchange's
transfer can overlap the next updates' computation; the leader takes the finished ones and broadcasts them to its
site's other replicas (LAN), so that every replica of a site applies the same updates at the same step. A dense
exchange (DiLoCo) is one all-reduce, then the same broadcast.

WAN traffic goes through gloo in host memory: the counts are needed on the host to size the receives, so a
leader on CUDA copies its payload out once per exchange (unverified on a GPU).
"""

from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as dist

from conveyor.gaia._sparse import decode, encode
from conveyor.runtime.parts import SiteLinks

__all__ = ["Courier", "Delivery", "Payload", "Received", "broadcast_dense", "mean_over_sites", "share_in_site"]

Received = list[tuple[int, torch.Tensor, torch.Tensor]]  # (sender's index, indices, values) of each payload
Payload = tuple[int, int, torch.Tensor]  # (sender's index among the sites, entries, their encoding)


class Delivery:
    """One finished exchange: its number (in post order), the other sites' payloads, the bytes this leader sent."""

    def __init__(self, update: int, payloads: list[Payload], sent: int) -> None:
        self.update, self.payloads, self.sent = update, payloads, sent


class Courier:
    """A site leader's sparse exchanges over the WAN, in update order, on a thread of its own.

    Args:
        links: the leader's links (``links.wan`` is used by this thread alone).
        n: the entries of the flat tensor the updates index.
    """

    def __init__(self, links: SiteLinks, n: int) -> None:
        assert links.wan is not None
        self.links, self.n = links, n
        self.posted = self.delivered = 0
        self._todo: queue.Queue[tuple[int, torch.Tensor | None, int]] = queue.Queue()
        self._done: queue.Queue[Delivery | BaseException] = queue.Queue()
        threading.Thread(target=self._run, name="conveyor-wan", daemon=True).start()

    def post(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """This update's significant entries, to every other site (the next exchange)."""
        k = int(indices.numel())
        self._todo.put((self.posted, encode(indices, values, self.n).cpu() if k else None, k))
        self.posted += 1

    def take(self, behind: int) -> list[Delivery]:
        """Every exchange finished so far, waiting for those more than ``behind`` updates old (the mirror clock)."""
        out: list[Delivery] = []
        while True:
            must = self.delivered < self.posted - behind
            try:
                item = self._done.get(block=must)
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                raise RuntimeError(f"the WAN exchange failed: {item}") from item
            out.append(item)
            self.delivered += 1

    def _run(self) -> None:
        while True:
            update, mine, k = self._todo.get()
            try:
                payloads, sent = self._swap(mine, k)
            except BaseException as e:  # handed to the training thread, which raises it
                self._done.put(e)
                return
            self._done.put(Delivery(update, payloads, sent))

    def _swap(self, mine: torch.Tensor | None, k: int) -> tuple[list[Payload], int]:
        """The notice, then the payloads: send ours to every other site, receive from those that announced some."""
        links, wan = self.links, self.links.wan
        gathered = [torch.zeros(2, dtype=torch.int64) for _ in range(links.sites)]
        dist.all_gather(gathered, torch.tensor([k, mine.numel() if mine is not None else 0]), group=wan)
        counts = [tuple(g.tolist()) for g in gathered]  # (entries, bytes) per site
        ops, received, sent = [], [], 16 * (links.sites - 1)
        for site, leader in enumerate(links.leaders):
            if site == links.index:
                continue
            if mine is not None:
                ops.append(dist.P2POp(dist.isend, mine, leader, group=wan))
                sent += mine.numel()
            if counts[site][0] > 0:
                buffer = torch.empty(counts[site][1], dtype=torch.uint8)
                received.append((site, counts[site][0], buffer))
                ops.append(dist.P2POp(dist.irecv, buffer, leader, group=wan))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return received, sent


def share_in_site(links: SiteLinks, payloads: list[Payload], n: int) -> Received:
    """The leader's ``payloads`` (empty on the others), broadcast to its site's replicas and decoded on each:
    their count, then their senders, entry counts and sizes, then their bytes in one tensor."""
    if links.local is not None:
        root, group = links.local_ranks[0], links.local
        count = torch.tensor([len(payloads)], device=links.device)
        dist.broadcast(count, root, group=group)
        heads = torch.tensor([[s, k, d.numel()] for s, k, d in payloads], dtype=torch.int64, device=links.device)
        heads = heads.reshape(-1, 3)
        if not links.is_leader:
            heads = torch.empty(int(count.item()), 3, dtype=torch.int64, device=links.device)
        if heads.numel():
            dist.broadcast(heads, root, group=group)
            sizes = heads[:, 2].tolist()
            flat = (
                torch.cat([data for _, _, data in payloads]).to(links.device)
                if links.is_leader
                else torch.empty(sum(sizes, start=0), dtype=torch.uint8, device=links.device)
            )
            dist.broadcast(flat, root, group=group)
            payloads = [(s, k, data) for (s, k, _), data in zip(heads.tolist(), flat.split(sizes), strict=True)]
    received: Received = []
    for site, k, data in payloads:
        received.append((site, *decode(data.to(links.device), n, k)))  # on the device, as the data
    return received


def mean_over_sites(links: SiteLinks, flat: torch.Tensor) -> int:
    """Average ``flat`` over the sites' leaders in place (leader only); the bytes this leader sent for it, as a
    ring all-reduce sends them: ``2 (s - 1) / s`` of the tensor."""
    assert links.wan is not None
    host = flat.cpu()
    dist.all_reduce(host, group=links.wan)
    flat.copy_(host / links.sites)
    return 2 * (links.sites - 1) * host.numel() * host.element_size() // links.sites


def broadcast_dense(links: SiteLinks, flat: torch.Tensor) -> None:
    """The leader's ``flat`` to its site's other replicas."""
    if links.local is not None:
        dist.broadcast(flat, links.local_ranks[0], group=links.local)
