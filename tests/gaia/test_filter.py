"""Gaia's significance filter, fused and in place, against the same arithmetic on packed copies."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conveyor.bench.gaia_filter import packed_select
from conveyor.gaia import SignificanceFilter


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    threshold=st.floats(0.0, 0.5),
    lr=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**16),
)
def test_the_fused_filter_selects_what_packed_copies_select(
    sizes: list[int], threshold: float, lr: float, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=generator)) for n in sizes]
    fused = SignificanceFilter(sum(sizes), threshold=threshold, device=torch.device("cpu"))
    pending, sent_at = fused.pending.clone(), fused.sent_at.clone()
    for update in range(4):
        for i, p in enumerate(params):  # the second parameter has no gradient at the first update
            p.grad = None if (i, update) == (1, 0) else 0.3 * torch.randn(p.shape, generator=generator)
        fused.add(params)
        chosen = fused.select(params, lr, update)
        reference = packed_select(pending, sent_at, params, lr, threshold, update)
        for a, b in zip(chosen, reference, strict=True):
            assert torch.equal(a, b)
        assert torch.equal(fused.pending, pending) and torch.equal(fused.sent_at, sent_at)


def test_with_no_threshold_every_nonzero_entry_goes_at_once() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    w.grad = torch.tensor([0.0, -0.5, 4.0])
    f = SignificanceFilter(3, threshold=0.0, device=torch.device("cpu"))
    f.add([w])
    indices, values, ages = f.select([w], lr=0.1, now=5)
    assert indices.tolist() == [1, 2] and values.tolist() == [-0.5, 4.0] and ages.tolist() == [6, 6]
    assert f.pending.tolist() == [0.0, 0.0, 0.0] and f.sent_at.tolist() == [-1, 5, 5]


def test_what_bfloat16_leaves_out_stays_pending() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    w.grad = torch.tensor([1.0 + 2**-10, 0.001, -3.0])
    f = SignificanceFilter(3, threshold=0.1, device=torch.device("cpu"), wire_dtype=torch.bfloat16)
    f.add([w])
    indices, values, _ = f.select([w], lr=1.0, now=0)
    assert indices.tolist() == [0, 2] and values.dtype == torch.bfloat16 and values.tolist() == [1.0, -3.0]
    # 1 + 2**-10 is not a bfloat16: its remainder waits, beside the insignificant entry
    assert torch.equal(f.pending, torch.tensor([2**-10, 0.001, 0.0]))
