"""Split any model that ``torch.export`` can trace into a sequence of blocks the planner can cut.

The model is exported twice, in training and in evaluation mode (BatchNorm and dropout differ), and each graph
is cut into the same *segments*: runs of operations that belong to the same submodule, the biggest refined into
their children until there are enough blocks for the planner. Segment ``i`` becomes a :class:`GraphBlock` whose
input is every value made before it and used at or after it, and whose output is every value made at or before
it and used after it (a tuple, or the tensor alone), so a skip connection simply rides through the blocks it
skips, and several tensors may cross any cut. The result is an ``nn.Sequential`` of blocks, what the profiler,
the planner and the pipeline already take.

A block holds the parameters and buffers its operations use, under the model's own names; a tensor used by
several segments (a tied embedding, named once or twice) is held by the first and passed on as a value, so its
gradient flows back to its one holder through the pipeline's backward sends: every schedule keeps it consistent.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Skip(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
    ...     def forward(self, x: torch.Tensor) -> torch.Tensor:
    ...         return self.b(torch.relu(self.a(x)) + x)
    >>> blocks = split_model(Skip(), torch.randn(3, 4))
    >>> [name for name, _ in blocks.named_children()]
    ['a', 'b']
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import InputError

__all__ = ["GraphBlock", "split_model"]

TARGET_BLOCKS = 16  # refine the biggest segments until there are this many (the planner cuts between them)


@dataclass
class _Segment:
    key: str  # the submodule its operations belong to ("" for the model's own forward)
    level: int  # how deep in the module tree the key is
    nodes: list[fx.Node] = field(default_factory=list)


def _module_paths(node: fx.Node) -> list[str]:
    """The submodules a node runs in, outermost first, without the model itself."""
    stack = node.meta.get("nn_module_stack") or {}
    return [path for path, _ in stack.values() if path]


def _key(node: fx.Node, level: int) -> str:
    paths = _module_paths(node)
    return paths[level - 1] if len(paths) >= level else ""


def _segments(nodes: list[fx.Node], level: int) -> list[_Segment]:
    """Runs of consecutive ``nodes`` under the same submodule at ``level``; an operation of an enclosing module
    (a residual add) joins the run before it."""
    segments: list[_Segment] = []
    for node in nodes:
        key = _key(node, level)
        if segments and (key == segments[-1].key or not key):
            segments[-1].nodes.append(node)
        else:
            segments.append(_Segment(key, level, [node]))
    return segments


def _refine(segments: list[_Segment], key: str) -> list[_Segment]:
    """``segments`` with each one under ``key`` cut into its children's runs."""
    out: list[_Segment] = []
    for segment in segments:
        if segment.key != key:
            out.append(segment)
            continue
        parts = _segments(segment.nodes, segment.level + 1)
        for part in parts:  # the module's own operations before its first child keep its key
            part.key = part.key or key
        out += parts
    return out


def _cut(nodes: list[fx.Node], weights: dict[str, int], target: int) -> tuple[list[_Segment], list[str]]:
    """Segments at the top level, the heaviest (by parameters, then operations) refined into its children
    until there are ``target`` or none can be; also the keys refined, in order, to cut another graph alike."""
    segments, refined = _segments(nodes, 1), []
    while len(segments) < target:
        deeper = [s for s in segments if s.key and any(len(_module_paths(n)) > s.level for n in s.nodes)]
        if not deeper:
            break
        big = max(deeper, key=lambda s: (weights.get(s.key, 0), len(s.nodes)))
        refined.append(big.key)
        segments = _refine(segments, big.key)
    return segments, refined


def _is_shape(node: fx.Node) -> bool:
    """Whether ``node`` computes a number from shapes (a batch size traced as dynamic), not a tensor."""
    return isinstance(node.meta.get("val"), int | float | bool | torch.SymInt | torch.SymFloat | torch.SymBool)


def _with_shapes(ops: list[fx.Node], parts: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """``parts`` (of the tensor operations) with each shape computation in the part of its last input, so that
    a size is read where its tensor is and only the number crosses the cuts after it."""
    part_of = {node: i for i, part in enumerate(parts) for node in part}
    for node in ops:
        if _is_shape(node):
            part_of[node] = max((part_of[n] for n in node.all_input_nodes if n in part_of), default=0)
    placed: list[list[fx.Node]] = [[] for _ in parts]
    for node in ops:
        placed[part_of[node]].append(node)
    return placed


def _replay(nodes: list[fx.Node], refined: list[str]) -> list[_Segment]:
    segments = _segments(nodes, 1)
    for key in refined:
        segments = _refine(segments, key)
    return segments


def _align(train: list[_Segment], other: list[_Segment]) -> list[list[fx.Node]]:
    """``other``'s operations per segment of ``train``: the same keys in the same order, where a submodule that
    runs no operation in ``other`` (dropout in evaluation) has an empty part.

    Raises:
        InputError: ``other`` runs submodules in an order ``train`` does not.
    """
    parts: list[list[fx.Node]] = []
    at = 0
    for segment in train:
        if at < len(other) and (other[at].key, other[at].level) == (segment.key, segment.level):
            parts.append(other[at].nodes)
            at += 1
        else:
            parts.append([])
    if at < len(other):
        raise InputError(
            f"the model runs {other[at].key or 'its own operations'} in evaluation where training does not: "
            "give it as an nn.Sequential of blocks instead"
        )
    return parts


def _export(model: nn.Module, example: tuple[Any, ...] | dict[str, Any], training: bool) -> fx.GraphModule:
    """``model`` traced on ``example`` (positional arguments, or keyword arguments by name)."""
    model.train(training)
    batch = torch.export.Dim.DYNAMIC  # microbatches, and an epoch's last batch, have other sizes than the example

    def dynamic(a: Any) -> Any:
        return {0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None

    args, kwargs = ((), example) if isinstance(example, dict) else (example, {})
    shapes = {k: dynamic(v) for k, v in kwargs.items()} if kwargs else tuple(dynamic(a) for a in args)
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes).module()
    except Exception as exc:
        raise InputError(
            f"torch.export cannot trace {type(model).__name__}: {_first_problem(str(exc))}: give the model as an "
            "nn.Sequential of blocks instead, or make that operation traceable"
        ) from None


def _first_problem(message: str) -> str:
    """The line of torch.export's (long) message that says what failed, and where in the user's code."""
    lines = message.splitlines()
    problem = next(
        (line for line in lines if line.strip() and not line[0].isspace() and not line.startswith("def ")), ""
    )
    marker = "The following call raised this error:"
    where = lines[lines.index(marker) + 1].strip() if marker in lines and lines.index(marker) + 1 < len(lines) else ""
    return (problem.strip()[:200] or "no message") + (f" ({where})" if where else "")


@dataclass
class _Graph:
    """One exported graph: its inputs, operations, attributes (by the name of their tensor) and outputs."""

    inputs: list[fx.Node]
    ops: list[fx.Node]
    attrs: dict[fx.Node, str]  # get_attr node -> the first name its tensor has in the model
    outputs: list[Any]  # the output node's flat values
    out_spec: Any
    keywords: list[str]  # the names of the inputs, in order, where the example gave keyword arguments


def _parse(gm: fx.GraphModule, model: nn.Module) -> _Graph:
    canonical: dict[int, str] = {}
    in_spec = getattr(gm, "_in_spec", None)  # ((args...), {kwargs...})
    children = [] if in_spec is None else in_spec.children() if hasattr(in_spec, "children") else in_spec.children_specs
    kwargs = children[1] if len(children) == 2 else None
    keywords = list(kwargs.context) if kwargs is not None and kwargs.type is dict else []
    graph = _Graph([], [], {}, [], getattr(gm, "_out_spec", None), keywords)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            graph.inputs.append(node)
        elif node.op == "get_attr":
            tensor = _attribute(model, str(node.target))
            graph.attrs[node] = canonical.setdefault(id(tensor), str(node.target))
        elif node.op == "output":
            flat = node.args[0]
            graph.outputs = list(flat) if isinstance(flat, tuple | list) else [flat]
        elif not (node.op == "call_module" and str(node.target).startswith("_guards")):
            graph.ops.append(node)  # (export's input guards are not the model's)
    return graph


def _attribute(model: nn.Module, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    value = getattr(model.get_submodule(owner), name)
    assert isinstance(value, torch.Tensor)
    return value


Value = fx.Node | str  # an input or an operation's result, or an attribute by its name


@dataclass
class _Flow:
    """Which values each segment holds, takes in and gives on."""

    holds: list[list[str]]  # the attributes first used in each segment
    live: list[list[Value]]  # live[i + 1]: made at or before segment i, used after it (live[0]: the inputs)


def _flow(graph: _Graph, parts: list[list[fx.Node]]) -> _Flow:
    last = len(parts)  # the output's "segment"
    segment_of = {node: i for i, part in enumerate(parts) for node in part}
    made: dict[Value, tuple[int, int, int]] = {node: (-1, 0, k) for k, node in enumerate(graph.inputs)}
    used: dict[Value, int] = {}

    def value(node: fx.Node) -> Value:
        return graph.attrs.get(node, node)

    for node, i in segment_of.items():
        made[node] = (i, 1, graph.ops.index(node))
        for source in node.all_input_nodes:
            v = value(source)
            used[v] = max(used.get(v, -1), i)
            if isinstance(v, str):
                made[v] = min(made.get(v, (i, 0, 0)), (i, 0, 0))
    for out in graph.outputs:
        if isinstance(out, fx.Node):
            used[value(out)] = last
            made.setdefault(value(out), (last - 1, 0, 0))
    order = sorted(made, key=lambda v: (*made[v], v if isinstance(v, str) else ""))
    holds = [[v for v in order if isinstance(v, str) and made[v][0] == i] for i in range(last)]
    live = [[v for v in order if made[v][0] < i <= used.get(v, -1)] for i in range(last + 1)]
    return _Flow(holds, live)


def _block_graph(
    graph: _Graph, part: list[fx.Node], *, holds: list[str], takes: list[Value], gives: list[Any]
) -> fx.GraphModule:
    """Segment ``part`` as a graph of ``(*held tensors, *values in) -> values out``."""
    g = fx.Graph()
    env: dict[Value, fx.Node] = {}
    for k, name in enumerate(holds):
        env[name] = g.placeholder(f"held_{k}")
    for k, v in enumerate(takes):
        env[v] = g.placeholder(f"value_{k}")

    def lookup(node: fx.Node) -> fx.Node:
        return env[graph.attrs.get(node, node)]

    for node in part:
        env[node] = g.node_copy(node, lookup)
    g.output(tuple(lookup(v) if isinstance(v, fx.Node) else env[v] if isinstance(v, str) else v for v in gives))
    return fx.GraphModule(nn.Module(), g)


@dataclass(frozen=True)
class _Code:
    """A block's graphs and output structure: no state, so every copy of the block (a weight version, a
    replica) shares them."""

    training: fx.GraphModule
    evaluation: fx.GraphModule
    out_spec: Any
    mutated: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())  # per mode: inputs written in place
    keywords: tuple[str, ...] = ()  # the first block's: the names its input mapping's values are taken by

    def __deepcopy__(self, memo: dict[int, Any]) -> _Code:
        return self


def _written_in_place(graph: fx.GraphModule, held: int) -> frozenset[int]:
    """Which of the graph's values in (after its ``held`` tensors) an operation writes in place (``x += y``)."""
    placeholders = {node: i - held for i, node in enumerate(graph.graph.find_nodes(op="placeholder")) if i >= held}
    written = set()
    for node in graph.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        for arg, spec in zip(node.args, schema.arguments if schema is not None else [], strict=False):
            if spec.alias_info is not None and spec.alias_info.is_write and arg in placeholders:
                written.add(placeholders[arg])
    return frozenset(written)


class GraphBlock(nn.Module):
    """One segment of a split model: the tensors it holds, under the model's names, and its operations in
    training and in evaluation, each a graph ``(*held tensors, *values in) -> values out``.

    Its input is the values the segments before it give on (a tuple, or the one tensor alone); so is its
    output, except the last block's, which is the model's own output.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        holds: list[str],
        training: fx.GraphModule,
        evaluation: fx.GraphModule,
        out_spec: Any = None,
        keywords: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        for name in holds:
            owner_name, _, attr = name.rpartition(".")
            owner, tensor = model.get_submodule(owner_name), _attribute(model, name)
            holder = self._holder(owner_name)
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(attr, tensor)
            else:
                holder.register_buffer(attr, tensor, persistent=attr not in owner._non_persistent_buffers_set)
        self.holds = holds
        mutated = (_written_in_place(training, len(holds)), _written_in_place(evaluation, len(holds)))
        self.code = _Code(training, evaluation, out_spec, mutated, keywords)  # not a submodule: its state is `holds`

    @property
    def out_spec(self) -> Any:
        """The structure of the model's output (``None`` on every block but the last)."""
        return self.code.out_spec

    def __repr__(self) -> str:  # one line: profiles and plans describe each block by it
        ops = [_op_name(n.target) for n in self.code.training.graph.nodes if n.op == "call_function"]
        return (
            f"GraphBlock({', '.join(dict.fromkeys(ops)) or 'no operation'}; holds {', '.join(self.holds) or 'nothing'})"
        )

    def _holder(self, path: str) -> nn.Module:
        module: nn.Module = self
        for part in path.split(".") if path else []:
            if part not in module._modules:
                module.add_module(part, nn.Module())
            child = module._modules[part]
            assert child is not None
            module = child
        return module

    def forward(self, values: Any) -> Any:
        held = [_attribute(self, name) for name in self.holds]
        graph = self.code.training if self.training else self.code.evaluation
        if self.code.keywords:  # the first block of a model traced on keyword arguments
            values = tuple(values[k] for k in self.code.keywords)
        values = values if isinstance(values, tuple) else (values,)
        written = self.code.mutated[0 if self.training else 1]
        if written:  # a value another stage sent is a leaf autograd cannot let an operation write: write a copy
            values = tuple(_writable(v) if i in written else v for i, v in enumerate(values))
        out = graph(*held, *values)
        if self.code.out_spec is not None:
            return pytree.tree_unflatten(list(out), self.code.out_spec)
        return out[0] if len(out) == 1 else tuple(out)


def _writable(value: Any) -> Any:
    leaf = isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad
    return value.clone() if leaf else value


def _op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``linear``; a Python function by its name."""
    text = str(target)
    return text.split(".")[1] if text.startswith("aten.") else getattr(target, "__name__", text)


def split_model(model: nn.Module, example: Any, *, target_blocks: int = TARGET_BLOCKS) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of :class:`GraphBlock` s (see the module docstring), which computes what
    ``model`` does, shares its parameters and buffers, and names each block after its submodule.

    Args:
        model: any module ``torch.export`` can trace; left in the mode it was given in.
        example: an input batch: a tensor, a tuple of the forward's positional arguments, or a dict of its
            keyword arguments (``input_ids``, ``attention_mask``), which the first block then takes.
        target_blocks: how many blocks to aim for (fewer where the model has fewer submodules).

    Raises:
        InputError: ``torch.export`` cannot trace the model (the message names the failing operation), or its
            training and evaluation graphs run different submodules.
    """
    args = example if isinstance(example, tuple | dict) else (example,)
    was_training = model.training
    try:
        training, evaluation = (_parse(_export(model, args, mode), model) for mode in (True, False))
    finally:
        model.train(was_training)
    weights = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules()}
    segments, refined = _cut([n for n in training.ops if not _is_shape(n)], weights, target_blocks)
    evaluation_segments = _replay([n for n in evaluation.ops if not _is_shape(n)], refined)
    parts = {
        "training": _with_shapes(training.ops, [s.nodes for s in segments]),
        "evaluation": _with_shapes(evaluation.ops, _align(segments, evaluation_segments)),
    }
    flows = {"training": _flow(training, parts["training"]), "evaluation": _flow(evaluation, parts["evaluation"])}
    blocks: dict[str, GraphBlock] = {}
    for i, segment in enumerate(segments):
        holds = sorted(set(flows["training"].holds[i]) | set(flows["evaluation"].holds[i]))
        graphs = []
        for mode, graph in (("training", training), ("evaluation", evaluation)):
            flow = flows[mode]
            takes: list[Value] = list(graph.inputs) if i == 0 else flow.live[i]
            gives = graph.outputs if i == len(segments) - 1 else flow.live[i + 1]
            graphs.append(_block_graph(graph, parts[mode][i], holds=holds, takes=takes, gives=gives))
        block = GraphBlock(
            model,
            holds=holds,
            training=graphs[0],
            evaluation=graphs[1],
            out_spec=training.out_spec if i == len(segments) - 1 else None,
            keywords=tuple(training.keywords) if i == 0 else (),
        )
        blocks[_block_name(segment.key, blocks)] = block
    _check_flows(flows["training"], flows["evaluation"])
    return nn.Sequential(OrderedDict(blocks))


def _block_name(key: str, taken: dict[str, GraphBlock]) -> str:
    base = key.replace(".", "_") or "ops"
    name, k = base, 1
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    return name


def _check_flows(training: _Flow, evaluation: _Flow) -> None:
    """Refuse a model whose evaluation graph passes other values between blocks than its training graph."""
    for i, (a, b) in enumerate(zip(training.live[1:-1], evaluation.live[1:-1], strict=True)):
        if len(a) != len(b) or any(isinstance(x, str) != isinstance(y, str) for x, y in zip(a, b, strict=True)):
            raise InputError(
                f"the model passes {len(a)} values after block {i} in training but {len(b)} in evaluation: "
                "give it as an nn.Sequential of blocks instead"
            )
    where = [{name: i for i, names in enumerate(flow.holds) for name in names} for flow in (training, evaluation)]
    for name in where[0].keys() & where[1].keys():
        if where[0][name] != where[1][name]:
            raise InputError(
                f"{name} is first used in block {where[0][name]} in training but {where[1][name]} in evaluation: "
                "give the model as an nn.Sequential of blocks instead"
            )
