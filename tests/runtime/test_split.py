"""Any traceable model, split into blocks, computes what it computes: outputs, gradients, buffers, in both modes;
and a pipeline of its blocks trains as the unsplit model does."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.errors import InputError
from conveyor.runtime import GraphBlock, Pipeline, launch, split_model

SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)


class SkipAcross(nn.Module):
    """A skip from the first block's output to the last, over three layers; a weight tied between two of
    them; a BatchNorm (or a LayerNorm) and a dropout."""

    def __init__(self, norm: str = "batch") -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.norm = nn.BatchNorm1d(16) if norm == "batch" else nn.LayerNorm(16)
        self.drop = nn.Dropout(0.0)
        self.l1, self.l2, self.l3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(16, 10)
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.l1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.drop(self.norm(torch.relu(self.inp(x))))
        h = torch.tanh(self.l3(torch.tanh(self.l2(torch.tanh(self.l1(skip))))))
        return self.out(h + skip) + self.tied(h)[:, :10]


def skip_across(norm: str = "batch") -> SkipAcross:
    torch.manual_seed(0)
    return SkipAcross(norm)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _state(blocks: nn.Module) -> dict[str, torch.Tensor]:
    """The blocks' state under the model's own names (a block's name is its first part)."""
    return {k.split(".", 1)[1]: v for k, v in blocks.state_dict().items()}


def test_blocks_compute_the_models_outputs_gradients_and_statistics() -> None:
    model, x = skip_across(), torch.randn(6, 8)
    reference = copy.deepcopy(model)
    blocks = split_model(model, x)
    assert all(isinstance(b, GraphBlock) for b in blocks)
    for _ in range(2):  # twice: the running statistics move alike
        F.cross_entropy(blocks(x), torch.arange(6)).backward()
        F.cross_entropy(reference(x), torch.arange(6)).backward()
    reference_grads = _grads(reference)
    for name, grad in _grads(model).items():  # the blocks share the model's parameters
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-6, atol=1e-7)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)
    blocks.eval()
    reference.eval()
    torch.testing.assert_close(blocks(x), reference(x))  # evaluation: the running statistics, not the batch's
    assert blocks.training is False and model.training  # the model keeps the mode it was given in


def test_a_skip_rides_through_the_blocks_between_and_a_tied_weight_is_held_once() -> None:
    model, x = skip_across(), torch.randn(6, 8)
    blocks = split_model(model, x)
    names = [name for name, _ in blocks.named_children()]
    assert names == ["inp", "norm", "drop", "l1", "l2", "l3", "out", "tied"]
    values = x
    crossing = []
    for block in blocks:
        values = block(values)
        crossing.append(len(values) if isinstance(values, tuple) else 1)
    # After l1: the skip, l1's output and the tied weight (l1 holds it; `tied` uses it last).
    assert crossing[names.index("l1")] == 3
    assert crossing[-1] == 1
    state = _state(blocks)
    assert "l1.weight" in state and "tied.weight" not in state
    assert set(state) == set(model.state_dict()) - {"tied.weight"}


def test_models_export_cannot_trace_get_one_line() -> None:
    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x) if x.sum() > 0 else -self.a(x)  # on the data: no one graph

    with pytest.raises(
        InputError, match=r"torch\.export cannot trace Branches: .*test_split\.py.* in forward"
    ) as error:
        split_model(Branches(), torch.randn(2, 4))
    assert "\n" not in str(error.value)


def test_fewer_blocks_when_asked() -> None:
    blocks = split_model(skip_across(), torch.randn(6, 8), target_blocks=1)
    assert len(blocks) == 8  # the top level is as coarse as it gets


def _hugging_face() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[models]')"
    )
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=50,
            n_positions=16,
            use_cache=False,
            bos_token_id=0,
            eos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )
    resnet = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    )
    return {"gpt2": (gpt2, torch.randint(0, 50, (4, 16))), "resnet": (resnet, torch.randn(4, 3, 32, 32))}


@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_hugging_face_models_split_as_they_come(name: str) -> None:
    """GPT-2 (tied embeddings, its causal mask made inside) and a ResNet (BatchNorm, shortcuts), from their
    library's constructors."""
    model, x = _hugging_face()[name]
    reference = copy.deepcopy(model)
    blocks = split_model(model, x)
    assert len(blocks) >= 8
    out, want = blocks(x).logits, reference(x).logits
    torch.testing.assert_close(out, want)
    out.square().mean().backward()
    want.square().mean().backward()
    reference_grads = _grads(reference)
    for param, grad in _grads(model).items():
        torch.testing.assert_close(grad, reference_grads[param], rtol=1e-5, atol=1e-6)
    blocks.eval()
    reference.eval()
    torch.testing.assert_close(blocks(x).logits, reference(x).logits)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]


def _reference(norm: str) -> dict[str, Any]:
    """Losses and weights after a step on each whole batch, and the evaluation after them."""
    model = skip_across(norm)
    opt = SGD(model.parameters())
    losses = []
    for x, y in _data():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    model.eval()
    with torch.no_grad():
        return {"losses": losses, "state": model.state_dict(), "eval": model(_data()[1][0])}


def _pipelined(norm: str, microbatches: int) -> dict[str, Any]:
    out = {}
    for schedule in ("gpipe", "flush"):
        blocks = split_model(skip_across(norm), _data()[0][0])
        pipe = Pipeline(blocks, [2, 3, 3], microbatches=microbatches, loss_fn=F.cross_entropy, optimizer=SGD)
        out[schedule] = {
            "losses": [pipe.train_step(x, y) for x, y in _data()],
            "state": _state(pipe.module),
            "eval": pipe.evaluate(_data()[1][0]),
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_pipeline_of_the_blocks_matches_one_step_on_the_whole_batch() -> None:
    """Three stages with BatchNorm: the skip crosses two cuts, the tied weight one (its stage-2 use gets it from
    stage 1, and its gradient goes back there). BatchNorm's statistics are the batch's, so it matches on one
    microbatch (tests/runtime/test_pipeline.py and test_async.py run a split model on more)."""
    norm = "batch"
    per_rank = launch(_pipelined, norm, 1, nprocs=3, timeout_s=150)
    want = _reference(norm)
    for schedule in ("gpipe", "flush"):
        state: dict[str, torch.Tensor] = {}
        for result in per_rank.values():
            state.update(result[schedule]["state"])
        assert set(state) == set(want["state"]) - {"tied.weight"}
        for name, value in state.items():
            torch.testing.assert_close(value, want["state"][name], rtol=1e-5, atol=1e-6, msg=f"{schedule} {name}")
        assert per_rank[2][schedule]["losses"] == pytest.approx(want["losses"], rel=1e-5)
        torch.testing.assert_close(per_rank[2][schedule]["eval"], want["eval"], rtol=1e-5, atol=1e-6)
