"""Any traceable model, split into blocks, computes what it computes: outputs, gradients, buffers, in both modes;
and a pipeline of its blocks trains as the unsplit model does."""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import small_gpt2
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


def _as_received(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """``values`` as the next stage receives them: each float tensor a leaf that needs its gradient."""
    return tuple(
        v.detach().requires_grad_() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values
    )


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


def test_a_model_that_raises_on_the_example_says_so_not_that_export_cannot_trace_it() -> None:
    """An RGB batch into a one-channel model: the model's own error, the batch and the model's line."""

    class Gray(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).flatten(1)

    with pytest.raises(InputError) as error:
        split_model(Gray(), torch.randn(4, 3, 8, 8))
    message = str(error.value)
    assert message.startswith("Gray raised RuntimeError on the example batch ((4, 3, 8, 8) float32) (test_split.py:")
    assert "return self.conv(x).flatten(1)" in message and "to have 1 channels, but got 3" in message
    assert "cannot trace" not in message and "\n" not in message


def test_fewer_blocks_when_asked() -> None:
    blocks = split_model(skip_across(), torch.randn(6, 8), target_blocks=1)
    assert len(blocks) == 8  # the top level is as coarse as it gets


def _hugging_face() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[models]')"
    )
    gpt2 = small_gpt2()
    resnet = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
    )
    sizes = {"d_model": 16, "encoder_ffn_dim": 32, "decoder_ffn_dim": 32, "max_position_embeddings": 32}
    heads = {"encoder_attention_heads": 2, "decoder_attention_heads": 2, "encoder_layers": 2, "decoder_layers": 2}
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(vocab_size=50, **sizes, **heads, dropout=0.0, attention_dropout=0.0, use_cache=False)
    )
    pairs = {"input_ids": torch.randint(3, 50, (4, 12)), "labels": torch.randint(3, 50, (4, 7))}
    return {
        "gpt2": (gpt2, torch.randint(0, 50, (4, 16))),
        "resnet": (resnet, torch.randn(4, 3, 32, 32)),
        "bart": (bart, pairs),  # its decoder's inputs made from the labels inside, the encoder's output crossing
    }


@pytest.mark.slow  # traces Hugging Face models (seconds)
@pytest.mark.parametrize("name", ["gpt2", "resnet", "bart"])
def test_hugging_face_models_split_as_they_come(name: str) -> None:
    """GPT-2 (tied embeddings, its causal mask made inside), a ResNet (BatchNorm, shortcuts) and BART (an encoder
    and a decoder, the labels given by name), from their library's constructors."""
    model, x = _hugging_face()[name]
    reference = copy.deepcopy(model)

    def unsplit(batch: Any) -> Any:
        return reference(**batch) if isinstance(batch, dict) else reference(batch)

    blocks = split_model(model, x)
    assert len(blocks) >= 8
    out, want = blocks(x).logits, unsplit(x).logits
    torch.testing.assert_close(out, want)
    out.square().mean().backward()
    want.square().mean().backward()
    reference_grads = _grads(reference)
    for param, grad in _grads(model).items():
        torch.testing.assert_close(grad, reference_grads[param], rtol=1e-5, atol=1e-6)
    blocks.eval()
    reference.eval()
    torch.testing.assert_close(blocks(x).logits, unsplit(x).logits)


def test_blocks_take_other_batch_sizes_and_a_value_another_stage_sent() -> None:
    """The batch dimension is traced as dynamic (microbatches and an epoch's last batch are smaller); a value
    that arrives from another stage (a leaf that needs its gradient) may be written in place (``h += x``)."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h += self.b(x).view(x.shape[0], 2, 2).flatten(1)  # a shape made of the batch size; h written
            return self.c(h)

    torch.manual_seed(0)
    model = InPlace()
    reference = copy.deepcopy(model)
    blocks = split_model(model, torch.randn(8, 4))
    assert [name for name, _ in blocks.named_children()] == ["a", "b", "c"]
    x = torch.randn(3, 4)
    given = blocks[0](x)  # x, h, and the batch size read where x is: it crosses as a number
    assert sorted(type(v).__name__ for v in given) == ["Tensor", "Tensor", "int"]
    assert [v for v in given if isinstance(v, int)] == [3]
    sent = _as_received(given)
    out = blocks[2](blocks[1](sent))
    out.sum().backward()
    want = reference(x)
    want.sum().backward()
    torch.testing.assert_close(out, want)
    back = [(v, s.grad) for v, s in zip(blocks[0](x), sent, strict=True) if getattr(v, "requires_grad", False)]
    assert len(back) == 1 and back[0][1] is not None  # h's gradient (x needs none)
    torch.autograd.backward([v for v, _ in back], [grad for _, grad in back])  # the gradients sent back
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, reference.get_parameter(name).grad, msg=name)
    torch.testing.assert_close(blocks(torch.ones(1, 4)), reference(torch.ones(1, 4)))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]


def _case(name: str) -> tuple[nn.Module, list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """A model, three batches for it, and its loss."""
    if name == "skip":
        return skip_across("batch"), _data(), F.cross_entropy
    model, _ = _hugging_face()[name.removesuffix("-mask")]
    g = torch.Generator().manual_seed(1)
    if name.startswith("gpt2"):
        windows = [torch.randint(0, 50, (8, 17), generator=g) for _ in range(3)]
        batches: list[tuple[Any, torch.Tensor]] = [(w[:, :-1], w[:, 1:]) for w in windows]  # the next token
        if name == "gpt2-mask":  # keyword inputs: the first rows padded at the start, the mask saying so
            mask = torch.ones(8, 16, dtype=torch.long)
            mask[:3, :4] = 0
            batches = [({"input_ids": x, "attention_mask": mask}, y) for x, y in batches]

        def next_token(out: Any, y: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())

        return model, batches, next_token
    batches = [(torch.randn(8, 3, 32, 32, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    return model, batches, lambda out, y: F.cross_entropy(out.logits, y)


def _reference(name: str) -> dict[str, Any]:
    """Losses and weights after a step on each whole batch, and the evaluation after them."""
    model, batches, loss_fn = _case(name)
    opt = SGD(model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(**x) if isinstance(x, dict) else model(x), y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
    model.eval()
    with torch.no_grad():
        x = batches[1][0]
        return {"losses": losses, "state": model.state_dict(), "eval": model(**x) if isinstance(x, dict) else model(x)}


# Per model: the workers' stage sizes (of the split's blocks), and microbatches (1 where BatchNorm would see
# other statistics on fewer samples than the batch).
LAYOUTS = {"skip": ((2, 3, 3), 1), "gpt2": ((9, None), 4), "gpt2-mask": ((9, None), 4), "resnet": ((8, None), 1)}


def _pipelined(name: str) -> dict[str, Any]:
    out = {}
    model, batches, loss_fn = _case(name)
    split = split_model(model, batches[0][0])  # once: a trace takes seconds, a copy of the split nothing
    for schedule in ("gpipe", "flush"):
        blocks = copy.deepcopy(split)
        (*balance, last), microbatches = LAYOUTS[name]
        balance = [*balance, last or len(blocks) - sum(balance)]
        pipe = Pipeline(blocks, balance, microbatches=microbatches, loss_fn=loss_fn, optimizer=SGD, schedule=schedule)
        out[schedule] = {
            "losses": [pipe.train_step(x, y) for x, y in batches],
            "state": _state(pipe.module),
            "eval": pipe.evaluate(batches[1][0]),
        }
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["skip", "gpt2", "gpt2-mask", "resnet"])
def test_a_pipeline_of_the_blocks_matches_one_step_on_the_whole_batch(name: str) -> None:
    """skip: three stages with BatchNorm; the skip crosses two cuts, the tied weight one (its stage-2 use gets it
    from stage 1, and its gradient goes back there). gpt2: two stages, the tied embedding used again by the
    head on the other stage, four microbatches; gpt2-mask: the same given keyword arguments, the attention mask
    reaching every block that uses it. resnet: two stages, BatchNorm, shortcuts, in-place adds on
    values the other stage sent. (tests/runtime/test_pipeline.py and test_async.py run a split model on more.)"""
    if name != "skip":
        _hugging_face()  # skips without transformers
    stages = len(LAYOUTS[name][0])
    per_rank = launch(_pipelined, name, nprocs=stages, timeout_s=200)
    want = _reference(name)
    tied = {"skip": {"tied.weight"}, "resnet": set()}.get(name, {"lm_head.weight"})
    for schedule in ("gpipe", "flush"):
        state: dict[str, torch.Tensor] = {}
        for result in per_rank.values():
            state.update(result[schedule]["state"])
        assert set(state) == set(want["state"]) - tied
        for key, value in state.items():
            torch.testing.assert_close(value, want["state"][key], rtol=1e-5, atol=1e-6, msg=f"{schedule} {key}")
        output = per_rank[stages - 1][schedule]
        assert output["losses"] == pytest.approx(want["losses"], rel=1e-5)
        got, expected = output["eval"], want["eval"]
        torch.testing.assert_close(
            getattr(got, "logits", got), getattr(expected, "logits", expected), rtol=1e-5, atol=1e-6
        )


class Regions(nn.Module):
    """A constant the trace lifts out of the code, a region under no_grad, and a training-only size read
    (stochastic depth, as torchvision's models have): training and evaluation pass different values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        with torch.no_grad():
            scale = h.abs().mean() + 1
        if self.training:
            h = h * (torch.rand(x.shape[0], 1) > -1)  # keeps every sample: deterministic
        return self.b(h / scale)


def test_constants_regions_and_a_size_read_only_in_training() -> None:
    torch.manual_seed(0)
    model = Regions()
    blocks = split_model(model, torch.randn(6, 4))
    x = torch.randn(3, 4)
    torch.testing.assert_close(blocks(x), model(x))
    blocks.eval()
    model.eval()
    torch.testing.assert_close(blocks(x), model(x))
    assert "lifted_tensor_0" not in "".join(blocks.state_dict())  # a constant is not saved


def test_an_example_of_one_sample_and_a_write_through_a_view_of_a_received_value() -> None:
    class ViewWrite(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h[:, :2] += self.b(x)  # writes h, which the block before made, through a view
            return h

    torch.manual_seed(0)
    model = ViewWrite()
    blocks = split_model(model, torch.randn(1, 4))  # one sample: traced on two, the batch still dynamic
    x = torch.randn(5, 4)
    given = blocks[0](x)
    received = _as_received(given)
    blocks[1](received).sum().backward()  # the copy of a leaf that needs its gradient, written through a view
    torch.testing.assert_close(blocks(x), model(x))


def test_a_buffer_written_away_from_where_it_is_first_used_is_refused() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("steps", torch.zeros(()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x) + self.steps
            out = self.b(h)
            self.steps.add_(1)  # in the model's own forward, after b: a later block than a, which reads it first
            return out

    with pytest.raises(InputError, match="steps is used first in block 0 but written in place in block 1"):
        split_model(Counter(), torch.randn(2, 4))


@pytest.mark.slow  # traces Hugging Face models (seconds)
def test_blocks_moved_to_another_device_run_there() -> None:
    """Graphs traced on the CPU name it (arange's device, export's checks); a block moved elsewhere runs a copy
    that names its own device (the meta device stands in for a GPU here)."""
    model, x = _hugging_face()["gpt2"]
    blocks = split_model(model, x).to("meta")
    assert blocks(x.to("meta")).logits.device.type == "meta"


def test_a_submodule_named_like_a_sequential_method_gets_a_number() -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.append, self.pop = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pop(self.append(x))

    blocks = split_model(Named(), torch.randn(2, 4))
    assert [name for name, _ in blocks.named_children()] == ["append_2", "pop_2"]


def _given_whole(stages: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SkipAcross("layer")
    x, y = torch.randn(8, 8), torch.randint(10, (8,))
    pipe = Pipeline(model, stages, example=x, microbatches=2, loss_fn=F.cross_entropy, optimizer=SGD, schedule="gpipe")
    return {"loss": pipe.train_step(x, y), "blocks": len(pipe.module)}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pipeline_given_the_module_and_an_example_splits_it_and_steps_as_the_module() -> None:
    """``Pipeline(model, 2, example=batch)``: split there, in two stages of as many blocks as can be."""
    per_rank = launch(_given_whole, 2, nprocs=2, timeout_s=100)
    torch.manual_seed(0)
    model = SkipAcross("layer")
    x, y = torch.randn(8, 8), torch.randint(10, (8,))
    assert per_rank[1]["loss"] == pytest.approx(F.cross_entropy(model(x), y).item(), rel=1e-6)
    blocks = len(split_model(model, x))
    assert [per_rank[r]["blocks"] for r in (0, 1)] == [-(-blocks // 2), blocks // 2]
