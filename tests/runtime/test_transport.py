"""Point-to-point transfer of pytrees between two real processes over gloo."""

import pytest
import torch
import torch.distributed as dist

import conveyor.runtime
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


def _exchange(staged: bool) -> tuple[object, set[str]]:
    """What each side received (on the CPU), and the device types it arrived on."""
    device = conveyor.runtime.default_device()
    p2p = P2P(device, staged=staged)
    if dist.get_rank() == 0:
        for i, msg in enumerate(_messages()):
            p2p.send_tree(msg, 1, samples=10 + i)
        got: object = p2p.recv_tensors([torch.zeros(3, device=device), torch.zeros(2, 2, dtype=torch.float64)], 1)
    else:
        got = [p2p.recv_tree(0) for _ in _messages()]  # (tree, samples) pairs
        p2p.send_tensors([torch.full((3,), 2.0, device=device), torch.eye(2, dtype=torch.float64)], 0)
    p2p.wait_sends()
    leaves = torch.utils._pytree.tree_leaves(got)
    return _to_cpu(got), {t.device.type for t in leaves if isinstance(t, torch.Tensor)}


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _to_cpu(tree: object) -> object:
    return torch.utils._pytree.tree_map_only(torch.Tensor, torch.Tensor.cpu, tree)


def _check(out: dict[int, tuple[object, set[str]]]) -> None:
    received = out[1][0]
    assert len(received) == len(_messages())
    for i, (sent, (got, samples)) in enumerate(zip(_messages(), received, strict=True)):
        assert _same(sent, got), (sent, got)
        assert samples == 10 + i
    grads = out[0][0]
    assert torch.equal(grads[0], torch.full((3,), 2.0))
    assert torch.equal(grads[1], torch.eye(2, dtype=torch.float64))


@pytest.mark.slow
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "through-host"])
def test_pytrees_and_gradients_arrive_intact(staged: bool) -> None:
    """On the CPU; ``staged`` takes the path CUDA tensors take (a host buffer between the device and gloo)."""
    _check(launch(_exchange, staged, nprocs=2, timeout_s=60))


@pytest.mark.gpu
def test_cuda_tensors_cross_through_host_memory_in_shared_gpu_mode() -> None:
    """Two workers on one GPU over gloo: activations and gradients of CUDA tensors (gloo's own send of a CUDA
    tensor would abort the process) arrive intact, on the receiver's GPU."""
    out = launch(_exchange, True, nprocs=2, device="cuda", backend="gloo", timeout_s=120)
    assert out[0][1] == out[1][1] == {"cuda"}
    _check(out)


def test_differentiable_leaves_are_the_floating_tensors_in_order() -> None:
    tree = {"a": torch.zeros(1), "b": (torch.zeros(1, dtype=torch.int64), torch.ones(2, dtype=torch.float16))}
    assert [t.dtype for t in differentiable_leaves(tree)] == [torch.float32, torch.float16]
