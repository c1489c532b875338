"""Tests for the warm-start weight transformation (Net2Net widening, narrowing, identity-initialised new layers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from conveyor.job._zoo import ResidualBlock, TransformerBlock, gpt, mlp, resnet
from conveyor.warmstart._transform import identity_init, transform, widen_linear_pair


def _same(parent: nn.Module, child: nn.Module, x: torch.Tensor) -> bool:
    parent.eval()
    child.eval()
    with torch.no_grad():
        return torch.allclose(parent(x), child(x), atol=1e-5)


def _randomise_bn(model: nn.Module) -> None:
    """Give BatchNorms non-trivial statistics and affine parameters, as a trained parent has."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-1, 1)
                m.running_var.uniform_(0.5, 2)
                m.weight.uniform_(0.5, 2)
                m.bias.uniform_(-1, 1)


def test_widened_mlp_computes_the_same_function() -> None:
    torch.manual_seed(0)
    parent, child = mlp(8, 3, width=16), mlp(8, 3, width=32)
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "2"), ("4", "4")], seed=1)
    assert report.actions == {"0": "widened", "2": "widened", "4": "widened"}
    assert report.coverage == 1.0
    assert _same(parent, child, torch.randn(20, 8))


def test_widen_linear_pair_replicates_units_and_divides_by_counts() -> None:
    w1, b1, w2 = torch.randn(2, 3), torch.randn(2), torch.randn(1, 2)
    v1, c1, v2 = widen_linear_pair(w1, b1, w2, 4, seed=0)
    assert torch.equal(v1[:2], w1) and torch.equal(c1[:2], b1)
    for j in range(4):  # each child unit is a copy of some parent unit, its outgoing weight divided by the copies
        i = next(i for i in range(2) if torch.equal(v1[j], w1[i]))
        copies = sum(torch.equal(v1[k], w1[i]) for k in range(4))
        assert torch.allclose(v2[0, j], w2[0, i] / copies)


def test_widened_conv_batchnorm_chain_computes_the_same_function() -> None:
    torch.manual_seed(0)

    def net(width: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(2, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(), nn.Conv2d(width, 3, 3, padding=1)
        )

    parent, child = net(4), net(7)
    _randomise_bn(parent)
    report = transform(parent.state_dict(), child, [("0", "0"), ("1", "1"), ("3", "3")])
    assert report.actions == {"0": "widened", "1": "widened", "3": "widened"}
    assert torch.equal(child[1].running_var[:4], parent[1].running_var)
    assert _same(parent, child, torch.randn(5, 2, 6, 6))


def test_widened_conv_through_flatten_into_linear() -> None:
    torch.manual_seed(0)

    def net(width: int) -> nn.Sequential:
        return nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(width * 4, 5)
        )

    parent, child = net(3), net(8)
    report = transform(parent.state_dict(), child, [("0", "0"), ("4", "4")])
    assert report.actions == {"0": "widened", "4": "widened"} and report.coverage == 1.0
    assert _same(parent, child, torch.randn(6, 1, 4, 4))


def test_deeper_mlp_with_an_identity_layer_keeps_its_output() -> None:
    torch.manual_seed(0)
    parent, child = mlp(8, 3, width=16, depth=2), mlp(8, 3, width=16, depth=3)
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "2"), ("4", "6")])
    assert report.actions == {"0": "copied", "2": "copied", "4": "identity", "6": "copied"}
    assert torch.equal(child[4].weight, torch.eye(16)) and not child[4].bias.any()
    assert _same(parent, child, torch.randn(10, 8))


def test_deeper_and_wider_mlp_keeps_its_output() -> None:
    torch.manual_seed(0)
    parent, child = mlp(8, 3, width=16, depth=2), mlp(8, 3, width=24, depth=3)
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "2"), ("4", "6")])
    assert report.actions["4"] == "identity"  # the widened units' map passes through the new layer
    assert _same(parent, child, torch.randn(10, 8))


def test_inserted_identity_conv_keeps_its_output() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1))
    child = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 2, 3, padding=1),
    )
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "4")])
    assert report.actions["2"] == "identity"
    assert _same(parent, child, torch.randn(3, 1, 5, 5))


def test_inserted_residual_block_keeps_its_output() -> None:
    torch.manual_seed(0)
    parent = resnet(1, 10, width=4, depth=1)  # stem (0, 1, 2), blocks 3 and 4, pool, flatten, linear 7
    _randomise_bn(parent)
    layers = list(resnet(1, 10, width=4, depth=1))
    child = nn.Sequential(*layers[:5], ResidualBlock(4, 4), *layers[5:])  # a third block, 5; linear now 8
    pairs = [("0", "0"), ("1", "1"), ("7", "8")]
    pairs += [(f"{b}.{n}", f"{b}.{n}") for b in ("3", "4") for n in ("conv1", "bn1", "conv2", "bn2")]
    report = transform(parent.state_dict(), child, pairs)
    assert {report.actions[f"5.{n}"] for n in ("conv1", "bn1", "conv2", "bn2")} == {"identity"}
    assert _same(parent, child, torch.randn(4, 1, 8, 8))


def test_narrowing_keeps_shapes_and_copies_the_largest_units() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    child = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "2")])
    assert report.actions == {"0": "narrowed", "2": "narrowed"} and report.coverage == 1.0
    kept = parent[0].weight.norm(dim=1).topk(3).indices.sort().values
    assert child[0].weight.shape == (3, 4) and child[2].weight.shape == (2, 3)
    assert torch.equal(child[0].weight, parent[0].weight[kept])
    assert torch.equal(child[0].bias, parent[0].bias[kept])
    assert torch.equal(child[2].weight, parent[2].weight[:, kept])
    assert torch.equal(child[2].bias, parent[2].bias)


def test_identical_architectures_copy_everything() -> None:
    torch.manual_seed(0)
    parent, child = resnet(1, 10, width=4, depth=2), resnet(1, 10, width=4, depth=2)
    _randomise_bn(parent)
    names = [n for n, m in parent.named_modules() if list(m.parameters(recurse=False))]
    report = transform(parent.state_dict(), child, [(n, n) for n in names])
    assert set(report.actions.values()) == {"copied"} and report.coverage == 1.0
    assert _same(parent, child, torch.randn(2, 1, 8, 8))


def test_coverage_on_a_mixed_case_by_hand() -> None:
    parent = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    child = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2), nn.Linear(2, 7))
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "4")])
    # "0": input 3 vs 4 -> the 5x3 overlap and the bias of 5 (20 of 20); "2": new square -> identity (30);
    # "4": copied (12); "5": new non-square -> default (21). From the parent: 20 + 12 of 83.
    assert report.actions == {"0": "sliced", "2": "identity", "4": "copied", "5": "default"}
    assert (report.set_elements, report.total_elements) == (32, 83)
    assert report.coverage == 32 / 83
    assert torch.equal(child[0].weight, parent[0].weight[:, :3])


def test_identity_init_leaves_other_operators_alone() -> None:
    assert not identity_init(nn.Linear(3, 4))
    assert not identity_init(nn.Conv2d(2, 2, 2))
    assert not identity_init(nn.Embedding(5, 3))
    conv = nn.Conv2d(3, 3, 3, padding=1)
    assert identity_init(conv)
    x = torch.randn(1, 3, 4, 4)
    assert torch.equal(conv(x), x)


@pytest.mark.parametrize(("width", "depth"), [(6, 1), (8, 2), (7, 3)])
def test_widened_resnet_computes_the_same_function(width: int, depth: int) -> None:
    """The stream's map crosses identity skips and 1x1 projections (depth >= 2) consistently."""
    torch.manual_seed(0)
    parent, child = resnet(1, 10, width=4, depth=depth), resnet(1, 10, width=width, depth=depth)
    _randomise_bn(parent)
    names = [n for n, m in parent.named_modules() if list(m.parameters(recurse=False))]
    report = transform(parent.state_dict(), child, [(n, n) for n in names], seed=depth)
    assert report.coverage == 1.0 and set(report.actions.values()) == {"widened"}
    assert _same(parent, child, torch.randn(3, 1, 8, 8))


def test_wider_transformer_models_fall_back_to_slicing() -> None:
    torch.manual_seed(0)
    parent, child, x = gpt(11, 8, width=16, depth=1), gpt(11, 8, width=32, depth=2), torch.randint(0, 11, (2, 8))
    names = [n for n, m in parent.named_modules() if list(m.parameters(recurse=False))]
    renamed = {"2": "3", "3": "4"}
    report = transform(parent.state_dict(), child, [(n, renamed.get(n, n)) for n in names])
    assert 0.0 < report.coverage < 1.0
    assert "sliced" in report.actions.values()
    child.eval()
    assert child(x).shape == parent(x).shape  # shapes stay right; the function only approximately kept


def test_new_transformer_block_is_zero_initialised_and_unknown_names_fail() -> None:
    torch.manual_seed(0)
    parent, child = gpt(11, 8, width=16, depth=1, dropout=0.0), gpt(11, 8, width=16, depth=2, dropout=0.0)
    names = [n for n, m in parent.named_modules() if list(m.parameters(recurse=False))]
    renamed = {"2": "3", "3": "4"}
    report = transform(parent.state_dict(), child, [(n, renamed.get(n, n)) for n in names])
    assert {a for n, a in report.actions.items() if n.startswith("2.")} == {"identity"}
    assert _same(parent, child, torch.randint(0, 11, (3, 8)))
    with pytest.raises(ValueError, match="does not have"):
        transform(parent.state_dict(), child, [("0", "9")])


def test_wider_mlp_with_an_inserted_transformer_block_keeps_its_output() -> None:
    torch.manual_seed(0)
    parent = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    child = nn.Sequential(nn.Linear(4, 12), nn.ReLU(), TransformerBlock(12, 2), nn.Linear(12, 3))
    report = transform(parent.state_dict(), child, [("0", "0"), ("2", "3")])
    assert report.actions["0"] == "widened" and report.actions["3"] == "widened"
    assert _same(parent, child, torch.randn(2, 5, 4))  # (batch, tokens, features): the block is the identity


def test_new_projecting_residual_block_embeds_its_input() -> None:
    torch.manual_seed(0)
    block = ResidualBlock(4, 8, stride=2).eval()
    assert identity_init(block)
    x = torch.relu(torch.randn(2, 4, 8, 8))  # a block's input follows a ReLU
    with torch.no_grad():
        y = block(x)
    assert torch.allclose(y[:, :4], x[:, :, ::2, ::2], atol=1e-4) and torch.count_nonzero(y[:, 4:]) == 0
    narrowing = ResidualBlock(8, 4, stride=2)  # fewer channels out than in: no embedding, left alone
    before = [p.clone() for p in narrowing.parameters()]
    assert not identity_init(narrowing)
    assert all(torch.equal(a, b) for a, b in zip(before, narrowing.parameters(), strict=True))


def _pairs(parent: nn.Module, skip: str = "") -> list[tuple[str, str]]:
    return [(n, n) for n, m in parent.named_modules() if list(m.parameters(recurse=False)) and n != skip]


def test_a_partly_paired_residual_block_passes_no_map_on() -> None:
    torch.manual_seed(0)
    parent, child = resnet(1, 10, width=4, depth=1), resnet(1, 10, width=6, depth=1)
    report = transform(parent.state_dict(), child, _pairs(parent, skip="3.conv2"))
    assert report.actions["3.conv1"] == "widened" and report.actions["3.conv2"] == "identity"
    # block 3's sum is no replica of the parent's channels: block 4 reads the overlap, and so does the rest
    assert report.actions["4.conv1"] == "sliced" and report.actions["7"] == "sliced"


def test_narrowed_resnet_keeps_shapes_and_sets_every_weight() -> None:
    torch.manual_seed(0)
    parent, child = resnet(1, 10, width=8, depth=2), resnet(1, 10, width=4, depth=2)
    report = transform(parent.state_dict(), child, _pairs(parent))
    assert set(report.actions.values()) == {"narrowed"} and report.coverage == 1.0
    assert child(torch.randn(2, 1, 8, 8)).shape == (2, 10)


def test_deeper_resnet_gets_an_embedding_stage_and_a_sliced_head() -> None:
    torch.manual_seed(0)
    parent, child = resnet(1, 10, width=4, depth=2), resnet(1, 10, width=4, depth=3)
    _randomise_bn(parent)
    renamed = {"9": "11"}  # the head moves past the two new blocks (7, 8)
    report = transform(parent.state_dict(), child, [(n, renamed.get(n, n)) for n, _ in _pairs(parent)])
    assert {a for n, a in report.actions.items() if n.startswith(("7.", "8."))} == {"identity"}
    assert report.actions["11"] == "sliced"  # 16 -> 32 features: the new channels are zero, their weights unused
    parent.eval()
    child.eval()
    x = torch.randn(64, 1, 8, 8)
    with torch.no_grad():
        near = (parent(x) - child(x)).abs().mean()
        far = (parent(x) - resnet(1, 10, width=4, depth=3).eval()(x)).abs().mean()
    assert near < far
