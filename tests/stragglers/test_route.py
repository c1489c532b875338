"""Routing by message: the receiver takes chunks in announcement order from any sender, and each gradient
returns to the replica that sent its chunk."""

import time

import pytest
import torch

from conveyor.runtime import launch
from conveyor.stragglers import Router
from conveyor.stragglers._route import END, FORWARD

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _exchange() -> dict:
    """Ranks 0 and 1 send chunks (rank 1 late), rank 2 doubles each; the gradient of sum(2 x) is 2."""
    torch.set_num_threads(1)
    rank = torch.distributed.get_rank()
    store = torch.distributed.distributed_c10d._get_default_store()
    router = Router(store, torch.device("cpu"))
    if rank < 2:
        if rank == 1:
            time.sleep(0.2)  # rank 0's chunks are announced first
        sent = []
        for chunk in (rank, rank + 2):
            x = torch.full((3, 2), float(chunk), requires_grad=True)
            out = x * 1.0
            router.send("q", out, step=0, chunk=chunk, count=4, start=3 * chunk, dst=2)
            sent.append((chunk, x, out))
        grads = {}
        for chunk, x, out in sent:  # gradients come back in the order this replica sent
            router.backward(out, src=2)
            grads[chunk] = x.grad.clone()
        if rank == 1:
            store.set("rank 1 sent", "yes")
        else:
            store.get("rank 1 sent")  # waits: the end is announced after every chunk
            router.notify("q", END, 1)
        router.wait_sends()
        return {"grads": grads}
    order = []
    for _ in range(4):
        entry = router.receive(router.next("q"))
        assert entry.start == 3 * entry.chunk
        order.append((entry.kind, entry.step, entry.chunk, entry.sender, float(entry.inputs[0, 0])))
        (2 * entry.inputs).sum().backward()
        router.send_grads(router.input_grads(entry), entry.sender)
    last = router.next("q")
    router.close("q")
    router.wait_sends()
    left = [store.check([key]) for key in ("q/size", *(f"q/{p}" for p in range(1, 6)))]
    return {"order": order, "last": (last.kind, last.step), "left": left}


def test_chunks_arrive_by_announcement_and_gradients_go_back_to_their_sender() -> None:
    out = launch(_exchange, nprocs=3, timeout_s=90)
    order = out[2]["order"]
    assert [(c, s) for _, _, c, s, _ in order] == [(0, 0), (2, 0), (1, 1), (3, 1)]
    assert all(kind == FORWARD and step == 0 for kind, step, *_ in order)
    assert all(value == chunk for _, _, chunk, _, value in order)  # each payload is the chunk its entry names
    assert out[2]["last"] == (END, 1)  # the run's end, with its step count
    assert not any(out[2]["left"])  # the reader deleted every place it read, and the queue's counter
    for rank in (0, 1):
        assert set(out[rank]["grads"]) == {rank, rank + 2}
        for grad in out[rank]["grads"].values():
            torch.testing.assert_close(grad, torch.full((3, 2), 2.0))
