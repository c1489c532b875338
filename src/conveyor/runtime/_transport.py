"""Point-to-point transfer of pytrees of tensors between pipeline workers over torch.distributed.

A stage may hand the next one a tensor, a tuple, a dict, or any nesting of them with plain Python
values mixed in. Every transfer is one message: a 16-byte header (the length of a description that
follows, if any, and the microbatch's sample count) and then every tensor's bytes, packed at 16-byte-
aligned offsets, so a microbatch costs one send and one receive however many tensors it has (on a
latency-bound pipeline the message count is what costs).

The receiver must post a buffer of the right size, so both ends remember the structure (tree, shapes,
dtypes, plain values) of the last message on the channel and expect the next to be the same. When it
changes, the sender first sends a message of the size the receiver expects whose header holds the length
of a description that follows; the receiver reads the description, then the data. Structure rarely
changes, so steady-state traffic is one message per microbatch.

Gradients flow back without a header: the receiver of a gradient is the worker that sent the activation,
so it knows the layout already.

Sends are asynchronous (``isend``): the executor never blocks on a send, only on the receive of data it
needs next. :meth:`P2P.wait_sends` waits for the outstanding ones (at the end of a run).

**CUDA tensors cross through pinned host memory, over gloo**, whatever backend the job's collectives use. A
message is packed on the GPU, copied once into a pinned host buffer and sent by gloo (the job's default
group in shared-GPU mode, else a gloo group of the same workers, :func:`host_group`); the receiver reads the
header from host memory (no wait for its GPU) and copies the payload to its GPU without blocking. Why not
NCCL's own send and receive: gloo's point-to-point messages of CUDA tensors abort the process, so shared-GPU
mode (the only multi-worker mode a one-GPU machine can test) needs this path anyway, and making it the only
path means the code that runs on a cluster is the code the tests ran; NCCL would also need every pair's sends
and receives posted in matching order on one stream (a 1F1B stage that sends a forward while its peer sends a
gradient back deadlocks), which routing by claims (:mod:`conveyor.stragglers`) cannot promise. The cost is
the host copies: GPUs joined by NVLink do not use it for activations (the all-reduces of replicas stay on
NCCL).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["P2P", "PendingRecv", "differentiable_leaves", "forget_host_groups", "host_group"]

_HEADER = 16  # bytes before the first tensor: two int64s, the description length and the sample count
_ALIGN = 16
_MAX_PENDING = 256  # sends kept until completion before the oldest is waited on


def differentiable_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of ``tree``, in flattening order: the ones gradients flow through."""
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@dataclass(frozen=True)
class _Layout:
    """Where each tensor of a message lives in its packed buffer."""

    shapes: tuple[tuple[torch.Size, torch.dtype], ...]
    offsets: tuple[int, ...]
    nbytes: int

    @classmethod
    def of(cls, shapes: list[tuple[torch.Size, torch.dtype]], start: int) -> _Layout:
        offsets, pos = [], start
        for shape, dtype in shapes:
            offsets.append(pos)
            size = shape.numel() * dtype.itemsize
            pos += -(-size // _ALIGN) * _ALIGN
        return cls(tuple(shapes), tuple(offsets), pos)

    def pack(self, tensors: list[torch.Tensor], header: tuple[int, int] | None, device: torch.device) -> torch.Tensor:
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        if header is not None:
            _write_header(buf, header)
        for t, view in zip(tensors, self.unpack(buf), strict=True):
            view.copy_(t.detach())
        return buf

    def unpack(self, buf: torch.Tensor) -> list[torch.Tensor]:
        return [
            buf[off : off + shape.numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), off in zip(self.shapes, self.offsets, strict=True)
        ]


@dataclass(frozen=True)
class _Channel:
    """What both ends of a channel know about the next message: its structure and packed layout."""

    signature: tuple[Any, list[Any]]
    spec: pytree.TreeSpec
    layout: _Layout


def _write_header(buf: torch.Tensor, header: tuple[int, int]) -> None:
    buf[:_HEADER].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))


_HOST_GROUPS: dict[int, dist.ProcessGroup] = {}


def host_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A gloo group of ``group``'s workers (default: all), for messages in host memory: ``group`` itself where it
    is gloo, else one made once per process (every worker of ``group`` must call this at the same point the first
    time; the launcher does it for the whole job at start-up)."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "torch.distributed is not initialised"
    if dist.get_backend(pg) == "gloo":
        return pg
    if id(pg) not in _HOST_GROUPS:
        ranks = None if pg is dist.group.WORLD else dist.get_process_group_ranks(pg)
        _HOST_GROUPS[id(pg)] = dist.new_group(ranks, backend="gloo")
    return _HOST_GROUPS[id(pg)]


def forget_host_groups() -> None:
    """Drop the groups :func:`host_group` made: their process group is gone (a new one may reuse its ``id``)."""
    _HOST_GROUPS.clear()


def _expected_size(channel: _Channel | None) -> int:
    """The size of the next message on a channel, assuming its structure has not changed."""
    return _HEADER if channel is None else channel.layout.nbytes


@dataclass
class PendingRecv:
    """A posted receive: its handle, the buffer it fills, and (for gradients) how to unpack it."""

    work: dist.Work | None
    buf: torch.Tensor
    src: int
    layout: _Layout | None = None

    def wait(self) -> None:
        """Block until the data has arrived (a receive of nothing returns at once)."""
        if self.work is not None:
            self.work.wait()


class P2P:
    """Sends and receives pytrees to and from other ranks of a process group.

    Args:
        device: where received tensors are placed (the worker's compute device).
        group: the process group; the default one if ``None``. Peers are global ranks.
        staged: send through host memory over gloo (default: on CUDA, see the module docstring); the CPU takes
            it too, which tests use.
        tag: the messages' tag: two P2Ps of one group with different tags keep their messages apart.
    """

    def __init__(
        self,
        device: torch.device,
        group: dist.ProcessGroup | None = None,
        *,
        staged: bool | None = None,
        tag: int = 0,
    ) -> None:
        self.device, self._tag = device, tag
        self._staged = device.type == "cuda" if staged is None else staged
        self._pin = self._staged and torch.cuda.is_available()
        # The ProcessGroup's own send/recv: torch.distributed.isend adds ~45 us of Python checks per call,
        # which a latency-bound pipeline pays on its critical path at every hop.
        world = dist.group.WORLD
        assert world is not None, "torch.distributed is not initialised"
        self._pg: dist.ProcessGroup = group if group is not None else world
        if self._staged:
            self._pg = host_group(self._pg)
        self._copies = torch.cuda.Stream(device) if self._staged and device.type == "cuda" else None
        self._group_rank: dict[int, int] = {}
        self._to: dict[int, _Channel] = {}
        self._from: dict[int, _Channel] = {}
        self._pending: deque[tuple[dist.Work, torch.Tensor]] = deque()

    def _isend(self, buf: torch.Tensor, dst: int) -> None:
        while len(self._pending) >= _MAX_PENDING:
            # A long run would otherwise keep every send's buffer. Gloo marks a send complete only once it is
            # waited on; a send this many messages old was received long ago (a schedule keeps only a
            # pipeline's depth of messages in flight), so the wait returns at once.
            self._pending.popleft()[0].wait()
        work = self._pg.send([buf], self._peer(dst), self._tag)
        # Keep the buffer alive until the send completes: the backend reads it asynchronously.
        self._pending.append((work, buf))

    def _peer(self, global_rank: int) -> int:
        if global_rank not in self._group_rank:
            self._group_rank[global_rank] = dist.get_group_rank(self._pg, global_rank)
        return self._group_rank[global_rank]

    def _recv(self, nbytes: int, src: int) -> torch.Tensor:
        pending = self._irecv(nbytes, src)
        pending.wait()
        return pending.buf

    def _irecv(self, nbytes: int, src: int) -> PendingRecv:
        buf = self._buffer(nbytes) if self._staged else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return PendingRecv(self._pg.recv([buf], self._peer(src), self._tag), buf, src)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A host buffer, pinned where there is CUDA (so copies to and from the GPU need not wait)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)

    def _message(self, layout: _Layout, tensors: list[torch.Tensor], header: tuple[int, int] | None) -> torch.Tensor:
        """``tensors`` packed as ``layout`` says, with ``header``: on the device, or staged, in a host buffer (packed
        on the device, then one copy, which waits for the device to have made them)."""
        if not self._staged:
            return layout.pack(tensors, header, self.device)
        host = self._buffer(layout.nbytes)
        host.copy_(layout.pack(tensors, None, self.device))
        if header is not None:
            _write_header(host, header)
        return host

    def _on_device(self, buf: torch.Tensor) -> torch.Tensor:
        """A received buffer where its tensors belong: a staged one copied to the device without the host waiting,
        on a stream of its own on CUDA (the copy engine then runs it beside the kernels already queued, and the
        compute stream waits for it only where it uses the data)."""
        if not self._staged:
            return buf
        if self._copies is None:
            return buf.to(self.device)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copies):
            moved = buf.to(self.device, non_blocking=True)
        compute.wait_stream(self._copies)
        moved.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        return moved

    def send_tree(self, tree: Any, dst: int, samples: int = 0) -> None:
        """Send ``tree`` (tensors detached) and a sample count to rank ``dst`` as one message (two more if its
        structure changed)."""
        leaves, spec = pytree.tree_flatten(tree)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        signature = (
            spec,
            [(t.shape, t.dtype) if isinstance(t, torch.Tensor) else ("value", t) for t in leaves],
        )
        channel = self._to.get(dst)
        if channel is None or channel.signature != signature:
            meta = pickle.dumps((pytree.treespec_dumps(spec), signature[1]))
            where = "cpu" if self._staged else self.device
            notice = torch.zeros(_expected_size(channel), dtype=torch.uint8, device=where)
            notice[:8].view(torch.int64).fill_(len(meta))
            self._isend(notice, dst)
            self._isend(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(where), dst)
            channel = _Channel(signature, spec, _Layout.of([(t.shape, t.dtype) for t in tensors], _HEADER))
            self._to[dst] = channel
        self._isend(self._message(channel.layout, tensors, (0, samples)), dst)

    def irecv_tree(self, src: int) -> PendingRecv:
        """Post the receive of the next pytree from ``src``; finish it with :meth:`wait_tree`.

        Posting early lets the data land while this worker computes, instead of waking it up later.
        At most one receive per source may be outstanding (its size assumes the structure is unchanged).
        """
        return self._irecv(_expected_size(self._from.get(src)), src)

    def wait_tree(self, pending: PendingRecv) -> tuple[Any, int]:
        """Complete a receive posted by :meth:`irecv_tree`: the pytree and its sample count."""
        pending.wait()
        buf, src = pending.buf, pending.src
        meta_bytes = int(buf[:8].view(torch.int64).item())  # a staged header is in host memory: no device wait
        if meta_bytes:
            spec_text, leaf_meta = pickle.loads(self._recv(meta_bytes, src).cpu().numpy().tobytes())
            spec = pytree.treespec_loads(spec_text)
            shapes = [(torch.Size(k), v) for k, v in leaf_meta if k != "value"]
            self._from[src] = _Channel((spec, leaf_meta), spec, _Layout.of(shapes, _HEADER))
            buf = self._recv(self._from[src].layout.nbytes, src)
        samples = int(buf[8:_HEADER].view(torch.int64).item())
        channel = self._from[src]
        tensors = iter(channel.layout.unpack(self._on_device(buf)))
        leaves = [value if kind == "value" else next(tensors) for kind, value in channel.signature[1]]
        return pytree.tree_unflatten(leaves, channel.spec), samples

    def recv_tree(self, src: int) -> tuple[Any, int]:
        """Receive the next pytree (and its sample count) that rank ``src`` sent with :meth:`send_tree`."""
        return self.wait_tree(self.irecv_tree(src))

    def send_tensors(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Send tensors whose shapes the receiver already knows (gradients of what it sent us), as one message."""
        if tensors:
            layout = _Layout.of([(t.shape, t.dtype) for t in tensors], 0)
            self._isend(self._message(layout, tensors, None), dst)

    def isend_tensors(self, tensors: list[torch.Tensor], dsts: list[int]) -> list[tuple[dist.Work, torch.Tensor]]:
        """Send ``tensors`` as :meth:`send_tensors` does to each of ``dsts`` (packed once), without keeping the sends:
        the caller waits on each handle returned, keeping its buffer alive until then, once it knows the receiver
        has it. For a receiver that may not read for a while (a frozen worker), whose sends must not hold up
        :meth:`wait_sends` or the oldest send's wait that bounds the ones kept here."""
        if not tensors:
            return []
        buf = self._message(_Layout.of([(t.shape, t.dtype) for t in tensors], 0), tensors, None)
        return [(self._pg.send([buf], self._peer(dst), self._tag), buf) for dst in dsts]

    def irecv_tensors(self, like: list[torch.Tensor], src: int) -> PendingRecv:
        """Post the receive of one tensor shaped like each of ``like``; finish it with :meth:`wait_tensors`."""
        layout = _Layout.of([(t.shape, t.dtype) for t in like], 0)
        if not like:
            return PendingRecv(None, torch.empty(0, dtype=torch.uint8), src, layout)
        return dataclasses.replace(self._irecv(layout.nbytes, src), layout=layout)

    def wait_tensors(self, pending: PendingRecv) -> list[torch.Tensor]:
        """Complete a receive posted by :meth:`irecv_tensors` and return the tensors."""
        pending.wait()
        assert pending.layout is not None, "a receive posted by irecv_tree: finish it with wait_tree"
        return pending.layout.unpack(self._on_device(pending.buf))

    def recv_tensors(self, like: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """Receive one tensor shaped like each of ``like``, in order, sent by :meth:`send_tensors`."""
        return self.wait_tensors(self.irecv_tensors(like, src))

    def wait_sends(self) -> None:
        """Block until every send issued so far has completed."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
