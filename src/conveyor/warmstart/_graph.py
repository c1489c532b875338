"""A model as a graph of operators from ``torch.fx``: the layers and structural ops architecture matching aligns."""

from __future__ import annotations

import json
import math
import operator
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from conveyor.errors import InputError

__all__ = ["KEPT_FUNCTIONS", "OpGraph", "OpNode", "op_graph"]

# Functions and methods kept as nodes (after stripping "i"-prefixed in-place forms such as iadd): arithmetic that joins
# branches (skips, attention), reshapes that change what a layer sees, activations. Everything else (getitem, getattr,
# size, view, permute, ...) is shape bookkeeping and dropped; its inputs pass through to the nodes it feeds.
KEPT_FUNCTIONS = frozenset(
    {
        "add",
        "sub",
        "mul",
        "truediv",
        "matmul",
        "bmm",
        "cat",
        "concat",
        "stack",
        "flatten",
        "relu",
        "gelu",
        "silu",
        "sigmoid",
        "tanh",
        "softmax",
        "mean",
        "scaled_dot_product_attention",
    }
)


@dataclass
class OpNode:
    """One operator of a model.

    Attributes:
        name: the qualified module name for a module call (``"3.conv1"``), the owning module's name for a bare
            parameter (``op == "Parameter"``), otherwise fx's node name for the function (``"add"``, ``"add_1"``).
        op: the module's class name (``"Linear"``, ``"Conv2d"``), ``"Parameter"``, or the function's name (``"add"``).
        params: parameter name -> shape, for the module's own parameters (empty for parameterless ops).
        inputs: indices (into :attr:`OpGraph.nodes`) of the kept nodes this one reads.
    """

    name: str
    op: str
    params: dict[str, tuple[int, ...]] = field(default_factory=dict)
    inputs: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        """The number of parameter elements."""
        return sum(math.prod(shape) for shape in self.params.values())


@dataclass
class OpGraph:
    """A model's operators in topological order.

    Attributes:
        nodes: the kept operators, each node's inputs before it.
        note: why the graph is a fallback chain of leaf modules (fx could not trace the model), else ``""``.

    Example:
        >>> g = op_graph(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))
        >>> [(n.name, n.op, n.params, n.inputs) for n in g.nodes][0]
        ('0', 'Linear', {'weight': (3, 4), 'bias': (3,)}, [])
        >>> [n.op for n in g.nodes], g.nodes[2].inputs
        (['Linear', 'ReLU', 'Linear'], [1])
        >>> OpGraph.from_json(g.to_json()) == g
        True
    """

    nodes: list[OpNode] = field(default_factory=list)
    note: str = ""

    @property
    def size(self) -> int:
        """The number of parameter elements over all nodes (a module called twice counts twice)."""
        return sum(n.size for n in self.nodes)

    def to_json(self) -> str:
        """The graph as a JSON string (shapes as lists)."""
        nodes = [
            {"name": n.name, "op": n.op, "params": {k: list(v) for k, v in n.params.items()}, "inputs": n.inputs}
            for n in self.nodes
        ]
        return json.dumps({"nodes": nodes, "note": self.note})

    @classmethod
    def from_json(cls, text: str) -> OpGraph:
        """Read back :meth:`to_json`'s string.

        Raises:
            ValueError: the text is not such a graph.
        """
        try:
            data = json.loads(text)
            nodes = [
                OpNode(
                    str(d["name"]),
                    str(d["op"]),
                    {str(k): tuple(int(x) for x in v) for k, v in d["params"].items()},
                    [int(i) for i in d["inputs"]],
                )
                for d in data["nodes"]
            ]
            return cls(nodes, str(data.get("note", "")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"not an OpGraph JSON: {exc!r}") from exc


def _own_params(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(p.shape) for k, p in module.named_parameters(recurse=False)}


def _function_name(node: fx.Node) -> str:
    target = node.target
    name = str(target) if node.op == "call_method" else getattr(target, "__name__", str(target))
    name = name.strip("_")
    if node.op == "call_function" and getattr(operator, name, None) is node.target and name.startswith("i"):
        name = name[1:]  # operator.iadd -> add
    return name


def _chain(model: nn.Module, note: str) -> OpGraph:
    """Leaf modules (and modules owning parameters directly) in registration order, each reading the previous."""
    nodes: list[OpNode] = []
    for name, module in model.named_modules():
        params = _own_params(module)
        if next(module.children(), None) is not None and not params:
            continue
        nodes.append(OpNode(name, type(module).__name__, params, [len(nodes) - 1] if nodes else []))
    return OpGraph(nodes, note)


def op_graph(model: nn.Module) -> OpGraph:
    """Trace ``model`` with ``torch.fx`` into an :class:`OpGraph`.

    Module calls become nodes named by their qualified name; parameters read directly (``get_attr``) become
    ``"Parameter"`` nodes named by their owning module; functions in :data:`KEPT_FUNCTIONS` (``add``, ``cat``, ...)
    stay, so skips and branches are visible; placeholders, outputs and shape bookkeeping are dropped, their inputs
    passed on. A model fx cannot trace becomes a chain of its leaf modules in registration order, with a note saying
    why; this never raises for a tracing failure.

    Args:
        model: the model.

    Returns:
        The graph, nodes in fx's (topological) order.

    Example:
        >>> from conveyor.job import resnet
        >>> g = op_graph(resnet(width=4, depth=1))
        >>> [n.op for n in g.nodes][:6], g.nodes[3].name, g.nodes[3].params
        (['Conv2d', 'BatchNorm2d', 'ReLU', 'Conv2d', 'BatchNorm2d', 'relu'], '3.conv1', {'weight': (4, 4, 3, 3)})
        >>> add = next(n for n in g.nodes if n.op == "add")
        >>> [g.nodes[i].name for i in add.inputs]  # the block's second BatchNorm and its skip (its input)
        ['3.bn2', '3.skip']
    """
    try:
        traced = fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many kinds (TraceError, TypeError, ...): any of them means "cannot trace"
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return _chain(model, f"fx could not trace {type(model).__name__} ({reason}): a chain of its leaf modules")
    modules = dict(traced.named_modules())
    nodes: list[OpNode] = []
    feeds: dict[fx.Node, frozenset[int]] = {}  # fx node -> the kept nodes it carries the values of
    for node in traced.graph.nodes:
        sources: frozenset[int] = frozenset().union(*(feeds.get(a, frozenset()) for a in node.all_input_nodes))
        kept: OpNode | None = None
        if node.op == "call_module":
            module = modules[str(node.target)]
            kept = OpNode(str(node.target), type(module).__name__, _own_params(module))
        elif node.op == "get_attr":
            owner, _, attr = str(node.target).rpartition(".")
            try:
                param = traced.get_parameter(str(node.target))
            except AttributeError:  # a buffer or constant: bookkeeping
                param = None
            if param is not None:
                kept = OpNode(owner, "Parameter", {attr: tuple(param.shape)})
        elif node.op in ("call_function", "call_method"):
            name = _function_name(node)
            if name in KEPT_FUNCTIONS:
                kept = OpNode(node.name, name)
        if kept is None:  # a shape read (x.shape, x.size()) carries no values: dependencies stop there
            shape_read = (node.op == "call_method" and node.target in ("size", "dim")) or node.target is getattr
            feeds[node] = frozenset() if shape_read else sources
        else:
            kept.inputs = sorted(sources)
            feeds[node] = frozenset({len(nodes)})
            nodes.append(kept)
    return OpGraph(nodes)
