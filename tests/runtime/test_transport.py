"""Point-to-point transfer of pytrees between two real processes over gloo."""

import pytest
import torch
import torch.distributed as dist

from conveyor.runtime import launch
from conveyor.runtime._transport import P2P, differentiable_leaves

pytestmark = pytest.mark.timeout(90)


def _messages() -> list[object]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(4, 3, generator=g),
        torch.randn(4, 3, generator=g),  # same structure: no description resent
        {
            "h": torch.randn(2, 5, generator=g),
            "ids": torch.arange(6).reshape(2, 3),
            "mask": torch.ones(2, dtype=torch.bool),
        },
        (torch.randn(7, generator=g).to(torch.bfloat16), None, "label", 3),
        (torch.randn(7, generator=g).to(torch.bfloat16), None, "label", 4),  # only a plain value changed
        torch.randn(1, 1, generator=g),  # shapes shrink
        torch.zeros(0, 4),  # an empty tensor
    ]


def _exchange() -> list[object] | None:
    p2p = P2P(torch.device("cpu"))
    if dist.get_rank() == 0:
        for i, msg in enumerate(_messages()):
            p2p.send_tree(msg, 1, samples=10 + i)
        grads = p2p.recv_tensors([torch.zeros(3), torch.zeros(2, 2, dtype=torch.float64)], 1)
        p2p.wait_sends()
        return grads
    got = [p2p.recv_tree(0) for _ in _messages()]  # (tree, samples) pairs
    p2p.send_tensors([torch.full((3,), 2.0), torch.eye(2, dtype=torch.float64)], 0)
    p2p.wait_sends()
    return got


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_pytrees_and_gradients_arrive_intact() -> None:
    out = launch(_exchange, nprocs=2, timeout_s=60)
    received = out[1]
    assert len(received) == len(_messages())
    for i, (sent, (got, samples)) in enumerate(zip(_messages(), received, strict=True)):
        assert _same(sent, got), (sent, got)
        assert samples == 10 + i
    assert torch.equal(out[0][0], torch.full((3,), 2.0))
    assert torch.equal(out[0][1], torch.eye(2, dtype=torch.float64))


def test_differentiable_leaves_are_the_floating_tensors_in_order() -> None:
    tree = {"a": torch.zeros(1), "b": (torch.zeros(1, dtype=torch.int64), torch.ones(2, dtype=torch.float16))}
    assert [t.dtype for t in differentiable_leaves(tree)] == [torch.float32, torch.float16]
