"""Architecture matching: alignments checked by hand, and a model index that shortlists before it aligns."""

import math

import numpy as np
import pytest
from torch import nn

import conveyor.warmstart._match as match_module
from conveyor.job import gpt, mlp, resnet, vgg
from conveyor.warmstart._graph import OpGraph, OpNode, op_graph
from conveyor.warmstart._match import ModelIndex, align, pair_score, signature


def layers(g: OpGraph) -> list[str]:
    return [n.name for n in g.nodes if n.params]


@pytest.mark.parametrize(
    "model",
    [mlp(width=16), resnet(width=4, depth=2), vgg(width=4), gpt(20, context=8, width=16, depth=2, heads=2)],
    ids=["mlp", "resnet", "vgg", "gpt"],
)
def test_a_model_aligned_with_itself_pairs_every_layer_with_itself(model: nn.Module) -> None:
    g = op_graph(model)
    a = align(g, g)
    assert a.pairs == [(name, name) for name in layers(g)]
    assert a.score == 1.0 and a.coverage == 1.0


def test_mlp_width_16_against_32_pairs_every_linear_with_partial_scores() -> None:
    a = align(op_graph(mlp(width=16)), op_graph(mlp(width=32)))
    assert a.pairs == [("0", "0"), ("2", "2"), ("4", "4")]
    # per layer: overlapping elements / the larger layer's elements, weight and bias together
    first = (64 * 16 + 16) / (64 * 32 + 32)  # 0.5
    hidden = (16 * 16 + 16) / (32 * 32 + 32)
    head = (10 * 16 + 10) / (10 * 32 + 10)
    assert a.score == pytest.approx((first + hidden + head) / 3)
    assert a.coverage == 1.0


def test_mlp_depth_2_against_3_pairs_the_shared_layers_in_order() -> None:
    a = align(op_graph(mlp(width=16, depth=2)), op_graph(mlp(width=16, depth=3)))
    # the child's extra hidden layer ("4") stays unpaired; the heads pair with each other
    assert a.pairs == [("0", "0"), ("2", "2"), ("4", "6")]
    assert a.score == pytest.approx(3 / 4)
    sizes = {"0": 64 * 16 + 16, "2": 16 * 16 + 16, "4": 16 * 16 + 16, "6": 10 * 16 + 10}
    assert a.coverage == pytest.approx((sizes["0"] + sizes["2"] + sizes["6"]) / sum(sizes.values()))


def test_a_deeper_parent_leaves_its_extra_layer_unused() -> None:
    a = align(op_graph(mlp(width=16, depth=3)), op_graph(mlp(width=16, depth=2)))
    assert a.pairs == [("0", "0"), ("2", "2"), ("6", "4")]
    assert a.score == 1.0 and a.coverage == 1.0


def test_resnet_depth_1_against_2_pairs_blocks_in_order() -> None:
    parent, child = op_graph(resnet(width=4, depth=1)), op_graph(resnet(width=4, depth=2))
    a = align(parent, child)
    stage = [f"{b}.{layer}" for b in (3, 4) for layer in ("conv1", "bn1", "conv2", "bn2")]
    # the stem and the shared first stage pair with themselves, the classifiers (Linear(4, 10) and Linear(8, 10))
    # with each other; the child's new stage (blocks 5 and 6) stays unpaired
    assert a.pairs == [("0", "0"), ("1", "1"), *((n, n) for n in stage), ("7", "9")]
    child_layers = len([n for n in child.nodes if n.params])  # 21: 2 + 4 blocks of 4 + 1 projection of 2 + 1
    assert child_layers == 21
    assert a.score == pytest.approx((10 + (4 * 10 + 10) / (8 * 10 + 10)) / 21)
    assert 0 < a.coverage < 1


def test_a_linear_never_pairs_with_a_conv2d() -> None:
    linear = OpNode("l", "Linear", {"weight": (4, 4), "bias": (4,)})
    conv = OpNode("c", "Conv2d", {"weight": (4, 4, 1, 1), "bias": (4,)})
    assert pair_score(linear, conv) == -math.inf
    a = align(op_graph(nn.Sequential(nn.Linear(4, 4))), op_graph(nn.Sequential(nn.Conv2d(4, 4, 1))))
    assert a.pairs == [] and a.score == 0.0 and a.coverage == 0.0
    # mixed: only same types pair, even where the other order would pair more
    parent = op_graph(nn.Sequential(nn.Conv2d(1, 4, 1), nn.Flatten(), nn.Linear(4, 4)))
    child = op_graph(nn.Sequential(nn.Linear(4, 4), nn.Unflatten(1, (4, 1, 1)), nn.Conv2d(4, 4, 1)))
    assert align(parent, child).pairs in ([("0", "2")], [("2", "0")])


def test_pair_score_is_the_fraction_of_overlapping_elements() -> None:
    a = OpNode("a", "Conv2d", {"weight": (8, 4, 3, 3)})
    b = OpNode("b", "Conv2d", {"weight": (4, 4, 3, 3)})
    assert pair_score(a, b) == pytest.approx(0.5) and pair_score(b, a) == pytest.approx(0.5)
    assert pair_score(OpNode("r", "ReLU"), OpNode("s", "ReLU")) == 1.0
    no_bias = OpNode("n", "Linear", {"weight": (4, 4)})
    assert pair_score(OpNode("l", "Linear", {"weight": (4, 4), "bias": (4,)}), no_bias) == pytest.approx(16 / 20)


def test_empty_graphs_align_to_nothing() -> None:
    g = op_graph(mlp(width=4))
    assert align(OpGraph(), g) == match_module.Alignment()
    assert align(g, OpGraph()) == match_module.Alignment()


def test_signature_is_fixed_length_and_near_for_similar_models() -> None:
    a, b, c = (signature(op_graph(m)) for m in (mlp(width=16), mlp(width=20), resnet(width=4)))
    assert a.shape == b.shape == c.shape == (match_module.SIGNATURE_LENGTH,)
    assert np.linalg.norm(a - b) < np.linalg.norm(a - c)
    assert signature(OpGraph()).sum() == 0.0


def test_index_picks_the_identical_architecture_at_equal_accuracy() -> None:
    index = ModelIndex()
    index.add("wide", op_graph(mlp(width=32)), 0.8)
    index.add("same", op_graph(mlp(width=16)), 0.8)
    index.add("cnn", op_graph(resnet(width=4)), 0.8)
    m = index.best(op_graph(mlp(width=16)))
    assert m.parent == "same" and m.alignment is not None and m.alignment.score == 1.0
    assert [r[0] for r in m.ranking][:2] == ["same", "wide"]
    assert m.reason == ""


def test_the_blend_prefers_a_more_accurate_near_identical_parent() -> None:
    index = ModelIndex()
    index.add("identical", op_graph(mlp(width=16)), 0.5)
    index.add("accurate", op_graph(mlp(width=18)), 0.95)
    child = op_graph(mlp(width=16))
    near = align(index.graphs[1], child).score
    assert 0.5 / 0.95 < near < 1.0  # so near * 0.95 > 1 * 0.5
    assert index.best(child, w=1.0).parent == "accurate"
    assert index.best(child, w=0.0).parent == "identical"  # similarity alone
    ranking = index.best(child, w=1.0).ranking
    assert ranking[0][3] == pytest.approx(near * 0.95) and ranking[1][3] == pytest.approx(0.5)


def test_index_errors_are_reasons_not_tracebacks() -> None:
    assert ModelIndex().best(op_graph(mlp(width=4))).reason == "no stored models"
    index = ModelIndex()
    index.add("cnn", op_graph(nn.Sequential(nn.Conv2d(1, 2, 3))), 0.9)
    assert index.best(OpGraph()).parent is None
    assert "no parameterised layers" in index.best(OpGraph()).reason
    m = index.best(op_graph(nn.Sequential(nn.Linear(2, 2))))
    assert m.parent is None and "shares a layer type" in m.reason and m.ranking[0][0] == "cnn"
    with pytest.raises(ValueError, match="already in the index"):
        index.add("cnn", OpGraph(), 0.5)
    with pytest.raises(ValueError, match="must lie in"):
        index.add("other", OpGraph(), 1.5)


def test_best_aligns_only_the_shortlist(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = [op_graph(m) for m in (mlp(width=8), mlp(width=16, depth=3), resnet(width=4), vgg(width=4))]
    index = ModelIndex()
    for i in range(200):
        index.add(f"m{i}", graphs[i % len(graphs)], 0.5 + (i % 7) / 20)
    calls: list[int] = []
    real = match_module.align

    def counting(parent: OpGraph, child: OpGraph) -> match_module.Alignment:
        calls.append(1)
        return real(parent, child)

    monkeypatch.setattr(match_module, "align", counting)
    child = op_graph(resnet(width=4))
    m = index.best(child, k=3)
    assert len(calls) == 3 and len(m.ranking) == 3
    assert all(index.graphs[index.ids.index(r[0])] is graphs[2] for r in m.ranking)  # the nearest: same resnet
    assert m.alignment is not None and m.alignment.score == 1.0
    assert index.shortlist(child, k=500)[:1] and len(index.shortlist(child, k=500)) == 200
