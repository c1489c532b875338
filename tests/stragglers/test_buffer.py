"""A step's buffer: its parts packed into one tensor and read back, without processes."""

import pytest
import torch

from conveyor.runtime.parts import set_mean_grads
from conveyor.stragglers._buffer import BufferLayout


def _params() -> list[torch.Tensor]:
    a, b, c = (
        torch.zeros(2, 3, requires_grad=True),
        torch.zeros(4, requires_grad=True),
        torch.zeros(1, requires_grad=True),
    )
    a.grad, b.grad = torch.arange(6.0).view(2, 3), torch.full((4,), -1.0)  # c has no gradient: zeros in its place
    return [a, b, c]


def test_every_part_reads_back_where_it_was_packed() -> None:
    params, terms = _params(), torch.tensor([0.5, 1.5, 2.5])
    layout = BufferLayout(terms=3, grads=11)
    flat = layout.pack(params, terms=terms, loss=torch.tensor(9.0), samples=4, extra=[10.0, 20.0])
    assert flat.shape == (3 + 11 + 2 + 2,)
    parts = layout.read(flat)
    assert torch.equal(parts.terms, terms)
    assert torch.equal(parts.grads, torch.cat([torch.arange(6.0), torch.full((4,), -1.0), torch.zeros(1)]))
    assert (parts.loss.item(), parts.samples.item(), parts.extra.tolist()) == (9.0, 4.0, [10.0, 20.0])
    set_mean_grads(params, parts.grads, 2)  # the update's mean gradient comes from the gradient part alone
    assert torch.equal(params[1].grad, torch.full((4,), -0.5)) and torch.equal(params[2].grad, torch.zeros(1))


def test_a_sum_of_buffers_is_the_buffer_of_the_sums() -> None:
    """What the all-reduce (or live reduction's sum of the chunks' buffers) relies on."""
    layout = BufferLayout(terms=0, grads=11)
    one = layout.pack(_params(), terms=None, loss=1.0, samples=2, extra=[3.0])
    two = layout.pack(_params(), terms=None, loss=5.0, samples=6, extra=[7.0])
    total = layout.read(one + two)
    assert (total.loss.item(), total.samples.item(), total.extra.tolist()) == (6.0, 8.0, [10.0])
    assert torch.equal(total.grads, 2 * layout.read(one).grads)
    assert layout.empty(1, torch.float64, torch.device("cpu")).shape == one.shape


def test_a_layout_that_does_not_fit_the_parts_is_refused() -> None:
    with pytest.raises(AssertionError):
        BufferLayout(terms=0, grads=10).pack(_params(), terms=None, loss=0.0, samples=1, extra=[])
    with pytest.raises(AssertionError):
        BufferLayout(terms=2, grads=11).pack(_params(), terms=torch.zeros(3), loss=0.0, samples=1, extra=[])
