"""A model built on the meta device: each worker makes real only its stage's tensors, initialised per module or
read from a file, and the pipeline trains as the unsplit model does."""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import small_gpt2
from torch import nn

from conveyor.errors import InputError
from conveyor.runtime import Pipeline, build_stage, initialise_from, is_on_meta, launch, load_from, split_model
from conveyor.runtime._materialize import placed

CPU = torch.device("cpu")


class Skip(nn.Module):
    """A skip over two layers, a BatchNorm, and a weight tied between two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = nn.Linear(8, 16), nn.BatchNorm1d(16)
        self.l1, self.l2, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 10)
        self.tied = nn.Linear(16, 16)
        self.tied.weight = self.l1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.norm(torch.relu(self.inp(x)))
        h = torch.tanh(self.l2(torch.tanh(self.l1(skip))))
        return self.out(h + skip) + self.tied(h)[:, :10]


def _on_meta(build: Any, example: torch.Tensor) -> tuple[nn.Module, nn.Sequential]:
    with torch.device("meta"):
        model = build()
    return model, split_model(model, example.to("meta"))


def _tensors(stage: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in [*stage.named_parameters(), *stage.named_buffers()]}


def test_a_stage_made_real_on_its_own_is_initialised_as_in_the_whole_model() -> None:
    model, blocks = _on_meta(Skip, torch.randn(4, 8))
    assert len(blocks) >= 3 and is_on_meta(blocks)
    stage = build_stage(blocks, (2, len(blocks)))
    initialise_from(model, seed=7)(stage, CPU)
    assert not is_on_meta(stage) and is_on_meta(build_stage(blocks, (0, 2)))  # the other blocks hold no memory
    assert model.inp.weight.is_meta  # the model outside the stage is left on the meta device
    whole_model, whole = _on_meta(Skip, torch.randn(4, 8))
    initialise_from(whole_model, seed=7)(whole, CPU)
    reference = _tensors(whole)
    for name, tensor in _tensors(stage).items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
    assert is_on_meta(whole_model) and not any(not t.is_meta for t in whole_model.parameters())  # the stage has them
    [running_var] = [v for k, v in reference.items() if k.endswith("norm.running_var")]
    assert torch.equal(running_var, torch.ones(16))  # BatchNorm's statistics reset too
    other_model, other = _on_meta(Skip, torch.randn(4, 8))
    initialise_from(other_model, seed=8)(other, CPU)
    [(key, out)] = [(k, v) for k, v in _tensors(other).items() if k.endswith("out.weight")]
    assert not torch.equal(out, reference[key])  # the seed decides


def test_a_module_without_reset_parameters_and_a_stage_without_values_say_what_to_do() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x * self.scale)

    model, blocks = _on_meta(Scaled, torch.randn(3, 4))
    with pytest.raises(InputError, match=r"cannot initialise the model \(Scaled\).*no reset_parameters\(\)"):
        initialise_from(model, seed=0)(blocks, CPU)
    with pytest.raises(InputError, match=r"built on the meta device.*materialize=initialise_from"):
        placed(_on_meta(Skip, torch.randn(3, 8))[1], CPU, None)


def test_a_stage_reads_only_its_tensors_from_a_state_dict_file(tmp_path: Path) -> None:
    torch.manual_seed(0)
    real = Skip()
    torch.save(real.state_dict(), tmp_path / "skip.pt")
    _, blocks = _on_meta(Skip, torch.randn(4, 8))
    stage = build_stage(blocks, (1, len(blocks)))
    load_from(tmp_path / "skip.pt")(stage, CPU)
    state = real.state_dict()
    for block in stage.children():
        for name, tensor in _tensors(block).items():
            torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    torch.save({k: v for k, v in state.items() if k != "out.bias"}, tmp_path / "short.pt")
    with pytest.raises(InputError, match=r"have no out.bias of shape \(10,\) \(missing\)"):
        load_from(tmp_path / "short.pt")(build_stage(_on_meta(Skip, torch.randn(4, 8))[1], (0, len(blocks))), CPU)


SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _lm_loss(logits: Any, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(logits, "logits", logits)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(50, (8, 12), generator=g), torch.randint(50, (8, 12), generator=g)) for _ in range(2)]


def _meta_pipeline(path: str) -> dict[str, Any]:
    """Each worker builds GPT-2 on the meta device and makes real only its stage: from the file, then afresh."""
    out: dict[str, Any] = {}
    with torch.device("meta"):
        built = small_gpt2()
    split = split_model(built, _batches()[0][0].to("meta"))  # once: a copy keeps the blocks' sharing with the model
    for how in ("file", "init"):
        model, blocks = copy.deepcopy((built, split))
        materialize = load_from(path) if how == "file" else initialise_from(model, seed=3)
        pipe = Pipeline(
            blocks, [9, len(blocks) - 9], microbatches=4, loss_fn=_lm_loss, optimizer=SGD, materialize=materialize
        )
        real = {k for k, v in _tensors(pipe.module).items() if not v.is_meta}
        unused = {k for k, v in _tensors(build_stage(blocks, (0, len(blocks)))).items() if v.is_meta}
        state = {k.partition(".")[2]: v.detach().clone() for k, v in pipe.module.state_dict().items()}
        losses = [pipe.train_step(x, y) for x, y in _batches()] if how == "file" else []
        out[how] = {"real": real, "meta": unused, "start": state, "losses": losses}
    return out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpt2_built_on_meta_trains_in_two_stages_as_the_unsplit_model(tmp_path: Path) -> None:
    """Two workers, each holding only its stage of a GPT-2 built on the meta device: read from the unsplit model's
    file, one gpipe step after another gives its losses; initialised afresh, each tensor is what the whole model
    initialised the same way holds, GPT-2's scaled projections included."""
    reference = small_gpt2()
    torch.save(reference.state_dict(), tmp_path / "gpt2.pt")
    per_rank = launch(_meta_pipeline, str(tmp_path / "gpt2.pt"), nprocs=2, timeout_s=200)
    optimizer = SGD(reference.parameters())
    want = []
    for x, y in _batches():
        optimizer.zero_grad()
        loss = _lm_loss(reference(x), y)
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    assert per_rank[1]["file"]["losses"] == pytest.approx(want, rel=1e-5)
    for result in per_rank.values():  # a worker holds its stage's tensors and none of the other's
        assert result["file"]["real"] and not result["file"]["real"] & result["file"]["meta"]
    assert per_rank[0]["file"]["real"] | per_rank[1]["file"]["real"] == _tensors_of_whole_split()
    with torch.device("meta"):
        model = small_gpt2()
    whole = split_model(model, _batches()[0][0].to("meta"))
    initialise_from(model, seed=3)(whole, CPU)
    expected = {k.partition(".")[2]: v for k, v in whole.state_dict().items()}
    for result in per_rank.values():
        for name, tensor in result["init"]["start"].items():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    projection = expected["transformer.h.0.mlp.c_proj.weight"].std().item()
    assert projection == pytest.approx(0.02 / 2, rel=0.1)  # initializer_range / sqrt(2 n_layer), as GPT-2 has it


def _tensors_of_whole_split() -> set[str]:
    with torch.device("meta"):
        model = small_gpt2()
    return set(_tensors(split_model(model, _batches()[0][0].to("meta"))))
