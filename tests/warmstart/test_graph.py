"""Operator graphs from torch.fx: zoo models trace, skips show as add nodes, a JSON round trip, the fallback chain."""

import pytest
import torch
from torch import nn

from conveyor.job import gpt, mlp, resnet, vgg
from conveyor.warmstart._graph import OpGraph, OpNode, op_graph


def test_mlp_graph_is_a_chain_of_its_modules() -> None:
    g = op_graph(mlp(inputs=8, classes=3, width=4, depth=2))
    assert [(n.name, n.op) for n in g.nodes] == [
        ("0", "Linear"),
        ("1", "ReLU"),
        ("2", "Linear"),
        ("3", "ReLU"),
        ("4", "Linear"),
    ]
    assert g.nodes[0].params == {"weight": (4, 8), "bias": (4,)}
    assert g.nodes[1].params == {}
    assert [n.inputs for n in g.nodes] == [[], [0], [1], [2], [3]]
    assert g.note == ""
    assert g.size == (4 * 8 + 4) + (4 * 4 + 4) + (3 * 4 + 3)


def test_resnet_graph_shows_its_skips_as_add_nodes() -> None:
    g = op_graph(resnet(width=4, depth=2))
    adds = [n for n in g.nodes if n.op == "add"]
    assert len(adds) == 4  # two residual blocks per stage, two stages
    names = [n.name for n in g.nodes]
    for add in adds:
        inputs = [g.nodes[i].name for i in add.inputs]
        assert len(inputs) == 2 and inputs[0].endswith(".bn2")  # the main branch and the skip
    # the first block keeps the shape (an Identity skip), the third projects (a 1x1 convolution and BatchNorm)
    assert [g.nodes[i].name for i in adds[0].inputs] == ["3.bn2", "3.skip"]
    assert [g.nodes[i].name for i in adds[2].inputs] == ["5.bn2", "5.skip.1"]
    assert g.nodes[names.index("5.skip.0")].params == {"weight": (8, 4, 1, 1)}
    assert g.nodes[names.index("3.conv1")].inputs == [names.index("2")]  # the stem's ReLU
    assert all(i < k for k, n in enumerate(g.nodes) for i in n.inputs)  # topological order


def test_vgg_and_gpt_trace() -> None:
    v = op_graph(vgg(width=4, depth=2))
    assert [n.op for n in v.nodes].count("Conv2d") == 4 and v.note == ""
    g = op_graph(gpt(20, context=8, width=16, depth=2, heads=2))
    ops = [n.op for n in g.nodes]
    assert g.note == ""
    assert ops[:3] == ["Embedding", "Parameter", "add"]
    assert g.nodes[1].name == "0" and g.nodes[1].params == {"positions": (8, 16)}
    assert ops.count("LayerNorm") == 5 and ops.count("Linear") == 9 and ops.count("add") == 5
    assert "getitem" not in ops and "view" not in ops  # shape bookkeeping is dropped


def test_json_round_trip() -> None:
    g = op_graph(resnet(width=4, depth=1))
    back = OpGraph.from_json(g.to_json())
    assert back == g
    assert isinstance(back.nodes[0].params["weight"], tuple)
    with pytest.raises(ValueError, match="not an OpGraph JSON"):
        OpGraph.from_json('{"nodes": [{"name": "x"}]}')


class Untraceable(nn.Module):
    """Control flow on a tensor's value: fx cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 3), nn.Linear(3, 1)
        self.block = nn.Sequential(nn.ReLU(), nn.LayerNorm(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        if y.sum() > 0:
            y = self.block(y)
        return self.b(y)


def test_untraceable_model_falls_back_to_a_chain_of_leaf_modules() -> None:
    g = op_graph(Untraceable())
    assert "fx could not trace Untraceable" in g.note
    assert [(n.name, n.op) for n in g.nodes] == [
        ("a", "Linear"),
        ("b", "Linear"),
        ("block.0", "ReLU"),
        ("block.1", "LayerNorm"),
    ]
    assert [n.inputs for n in g.nodes] == [[], [0], [1], [2]]
    assert OpNode("x", "ReLU").size == 0
