"""Split any model that ``torch.export`` can trace into a sequence of blocks the planner can cut.

The model is exported twice, in training and in evaluation mode (BatchNorm and dropout differ), with the batch
dimension of every input dynamic, and each graph is cut into the same *segments* (:mod:`conveyor.runtime._cut`):
runs of operations that belong to the same submodule, the heaviest refined into their children until there are
enough blocks for the planner. Segment ``i`` becomes a :class:`~conveyor.runtime.GraphBlock` whose
input is every value made before it and used at or after it, and whose output is every value made at or before
it and used after it (a tuple, or the tensor alone), so a skip connection simply rides through the blocks it
skips, and several tensors may cross any cut. The result is an ``nn.Sequential`` of blocks, what the profiler,
the planner and the pipeline already take.

A block holds the parameters and buffers its operations use, under the model's own names; a tensor used by
several segments (a tied embedding, named once or twice) is held by the first and passed on as a value, so its
gradient flows back to its one holder through the pipeline's backward sends: every schedule keeps it consistent.
A constant the trace made (``x * torch.tensor([...])``) is held, unsaved, by the block that uses it first; a
region under ``torch.no_grad()`` or ``torch.autocast`` is a subgraph that goes with the block calling it.

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

import operator
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from conveyor.errors import InputError
from conveyor.runtime._cut import Segment, cut, cut_alike
from conveyor.runtime._graph_block import GraphBlock, view_base, written_args

__all__ = ["split_model"]

TARGET_BLOCKS = 16  # refine the biggest segments until there are this many (the planner cuts between them)
INSTEAD = "give the model as an nn.Sequential of blocks instead"


def _export(model: nn.Module, example: tuple[Any, ...] | dict[str, Any], training: bool) -> fx.GraphModule:
    """``model`` traced on ``example`` (positional arguments, or keyword arguments by name), dimension 0 of every
    input tensor dynamic: microbatches, and an epoch's last batch, are smaller than the example."""
    model.train(training)
    batch = torch.export.Dim.DYNAMIC

    def dynamic(a: Any) -> Any:
        return {0: batch} if isinstance(a, torch.Tensor) and a.dim() > 0 else None

    args, kwargs = ((), example) if isinstance(example, dict) else (example, {})
    shapes = {k: dynamic(v) for k, v in kwargs.items()} if kwargs else tuple(dynamic(a) for a in args)
    try:
        return torch.export.export(model, args, kwargs, dynamic_shapes=shapes).module()
    except Exception as exc:
        _raise_if_the_model_fails(model, args, kwargs)  # its own error on this batch, not the tracer's
        raise InputError(
            f"torch.export cannot trace {type(model).__name__}: {_first_problem(str(exc))}: {INSTEAD}, or make "
            "that operation traceable"
        ) from None


def _raise_if_the_model_fails(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Run ``model`` on the example as it is, without tracing; if it raises, say so: its message, the batch's
    shapes and dtypes, and the line of the model's code that raised (not the tracer's advice).

    Raises:
        InputError: the model raises on the example.
    """
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as exc:
        ours = (_TORCH, __file__)  # the frames of torch and of this call: the model's line is the last other
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(ours)]
        where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno}: {frames[-1].line})" if frames else ""
        message = str(exc).splitlines()[0] if str(exc) else ""
        raise InputError(
            f"{type(model).__name__} raised {type(exc).__name__} on the example batch ({_describe_batch(args, kwargs)})"
            f"{where}: {message}"
        ) from None


_TORCH = str(Path(torch.__file__).parent)


def _describe_batch(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The shapes and dtypes of a forward's tensors, e.g. ``(64, 3, 8, 8) float32``, keyword ones by name.

    Example:
        >>> _describe_batch((torch.zeros(2, 3),), {"mask": torch.ones(2, dtype=torch.bool)})
        '(2, 3) float32, mask (2,) bool'
    """

    def one(t: Any) -> str:
        return (
            f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
            if isinstance(t, torch.Tensor)
            else type(t).__name__
        )

    return ", ".join([one(a) for a in args] + [f"{k} {one(v)}" for k, v in kwargs.items()])


def _at_least_two(example: Any) -> Any:
    """``example`` with a batch of one sample doubled: export takes a dimension of size 1 for a constant."""

    def doubled(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t]) if t.dim() > 0 and t.shape[0] == 1 else t

    return pytree.tree_map_only(torch.Tensor, doubled, example)


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
    """One exported graph: its inputs, operations, tensors by name (the first name the model has for each), the
    subgraphs its regions call, and its outputs."""

    inputs: list[fx.Node]
    ops: list[fx.Node]
    attrs: dict[fx.Node, str] = field(default_factory=dict)  # get_attr node -> the name of its tensor
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> the model's tensor or a constant
    constants: set[str] = field(default_factory=set)  # the names of tensors the trace made (not the model's)
    subgraphs: dict[fx.Node, tuple[str, nn.Module]] = field(default_factory=dict)  # get_attr node -> its region
    outputs: list[Any] = field(default_factory=list)  # the output node's flat values
    out_spec: Any = None
    keywords: list[str] = field(default_factory=list)  # the inputs' names, where traced on keyword arguments


def _parse(gm: fx.GraphModule, model: nn.Module) -> _Graph:
    graph = _Graph([], [], out_spec=getattr(gm, "_out_spec", None), keywords=_keywords(gm))
    canonical: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            graph.inputs.append(node)
        elif node.op == "get_attr":
            _parse_attribute(graph, node, model, gm, canonical)
        elif node.op == "output":
            flat = node.args[0]
            graph.outputs = list(flat) if isinstance(flat, tuple | list) else [flat]
        elif not (node.op == "call_module" and str(node.target).startswith("_guards")):
            graph.ops.append(node)  # (export's input guards are not the model's)
    return graph


def _keywords(gm: fx.GraphModule) -> list[str]:
    in_spec = getattr(gm, "_in_spec", None)  # ((args...), {kwargs...})
    children = [] if in_spec is None else in_spec.children() if hasattr(in_spec, "children") else in_spec.children_specs
    kwargs = children[1] if len(children) == 2 else None
    return list(kwargs.context) if kwargs is not None and kwargs.type is dict else []


def _parse_attribute(
    graph: _Graph, node: fx.Node, model: nn.Module, gm: fx.GraphModule, canonical: dict[int, str]
) -> None:
    """A tensor of the model, by the first name of it seen (a tied weight may have two); a constant; or a
    region's subgraph."""
    target = str(node.target)
    tensor = _model_tensor(model, target)
    if tensor is not None:
        name = canonical.setdefault(id(tensor), target)
        graph.attrs[node], graph.tensors[name] = name, tensor
        return
    value = operator.attrgetter(target)(gm)
    if isinstance(value, nn.Module):
        graph.subgraphs[node] = (target, value)
    else:
        graph.attrs[node], graph.tensors[target] = target, value
        graph.constants.add(target)


def _model_tensor(model: nn.Module, target: str) -> torch.Tensor | None:
    owner, _, name = target.rpartition(".")
    try:
        value = getattr(model.get_submodule(owner), name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None


Value = fx.Node | str  # an input or an operation's result, or a held tensor by its name


@dataclass
class _Flow:
    """Which tensors each segment holds, and which values cross each cut."""

    holds: list[list[str]]  # the tensors first used in each segment
    live: list[list[Value]]  # live[i + 1]: made at or before segment i and used after it (live[0]: the inputs)


def _flow(graph: _Graph, parts: list[list[fx.Node]]) -> _Flow:
    """Each value is *made* in a segment (an input before the first, a held tensor where it is first used) and
    *used* up to the last segment that reads it (the output's: one past the last); it crosses every cut between.
    Values cross in the order they are made, so the blocks of one graph agree on it."""
    output = len(parts)
    made: dict[Value, tuple[int, float]] = {node: (-1, k) for k, node in enumerate(graph.inputs)}  # (segment, order)
    used: dict[Value, int] = {}
    position = 0
    for i, part in enumerate(parts):
        for node in part:
            made[node] = (i, position)
            for source in node.all_input_nodes:
                v = graph.attrs.get(source, source)
                used[v] = max(used.get(v, -1), i)
                made.setdefault(v, (i, position - 0.5))  # a held tensor: just before its first user
            position += 1
    for out in graph.outputs:
        if isinstance(out, fx.Node):
            v = graph.attrs.get(out, out)
            used[v] = output
            made.setdefault(v, (output - 1, position))
    order = sorted(made, key=lambda v: made[v])
    holds = [[v for v in order if isinstance(v, str) and made[v][0] == i] for i in range(output)]
    live = [[v for v in order if made[v][0] < i <= used.get(v, -1)] for i in range(output + 1)]
    return _Flow(holds, live)


def _check_writes(graph: _Graph, parts: list[list[fx.Node]], flow: _Flow) -> None:
    """Refuse a buffer written in place by another block than the one that holds it: the write would land on the
    copy a later stage receives, and be lost."""
    holder = {name: i for i, names in enumerate(flow.holds) for name in names}
    for i, part in enumerate(parts):
        for node in part:
            for arg in written_args(node):
                name = graph.attrs.get(view_base(arg))
                if name is not None and holder.get(name, i) != i:
                    raise InputError(
                        f"{name} is used first in block {holder[name]} but written in place in block {i}: {INSTEAD}"
                    )


def _block_graph(
    graph: _Graph, part: list[fx.Node], *, holds: list[str], takes: list[Value], gives: list[Any]
) -> fx.GraphModule:
    """Segment ``part`` as a graph of ``(*held tensors, *values in) -> values out``; the regions it calls are
    submodules of the graph's root."""
    g, root = fx.Graph(), nn.Module()
    env: dict[Value, fx.Node] = {}
    for k, name in enumerate(holds):
        env[name] = g.placeholder(f"held_{k}")
    for k, v in enumerate(takes):
        env[v] = g.placeholder(f"value_{k}")

    def lookup(node: fx.Node) -> fx.Node:
        if node in graph.subgraphs:
            name, region = graph.subgraphs[node]
            if not hasattr(root, name):
                root.add_module(name, region)
            return g.get_attr(name)
        return env[graph.attrs.get(node, node)]

    for node in part:
        env[node] = g.node_copy(node, lookup)
    g.output(tuple(_give(v, env, lookup) for v in gives))
    return fx.GraphModule(root, g)


def _give(value: Any, env: dict[Value, fx.Node], lookup: Any) -> Any:
    """An output: a node of the graph, a held tensor by name, or a constant the model returns as it is."""
    if isinstance(value, fx.Node):
        return lookup(value)
    return env[value] if isinstance(value, str) else value


def _check_holders(training: _Flow, evaluation: _Flow) -> None:
    """Refuse a tensor that training and evaluation first use in different blocks (it would be held twice)."""
    where = [{name: i for i, names in enumerate(flow.holds) for name in names} for flow in (training, evaluation)]
    for name in where[0].keys() & where[1].keys():
        if where[0][name] != where[1][name]:
            raise InputError(
                f"{name} is first used in block {where[0][name]} in training but {where[1][name]} in evaluation: "
                f"{INSTEAD}"
            )


def split_model(model: nn.Module, example: Any, *, target_blocks: int = TARGET_BLOCKS) -> nn.Sequential:
    """``model`` as an ``nn.Sequential`` of :class:`~conveyor.runtime.GraphBlock` s (see the module docstring),
    which computes what ``model`` does, shares its parameters and buffers, and names each block after its
    submodule.

    Args:
        model: any module ``torch.export`` can trace; left in the mode it was given in. One built on the meta
            device (``with torch.device("meta"):``) is traced there, and its blocks hold tensors without values
            until a worker makes its stage real (:func:`~conveyor.runtime.initialise_from`).
        example: an input batch: a tensor, a tuple of the forward's positional arguments, or a dict of its
            keyword arguments (``input_ids``, ``attention_mask``), which the first block then takes. Dimension 0
            of every tensor in it is the batch. It is moved to the meta device for a model built there.
        target_blocks: how many blocks to aim for (fewer where the model has fewer submodules).

    Raises:
        InputError: ``torch.export`` cannot trace the model (the message names the failing operation and its
            line), a buffer is written in place away from where it is first used, or training and evaluation
            first use a tensor in different blocks.
    """
    example = _at_least_two(example if isinstance(example, tuple | dict) else (example,))
    if any(t.is_meta for t in model.parameters()):  # built on the meta device: traced there, nothing computed
        example = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), example)
    was_training = model.training
    try:
        training, evaluation = (_parse(_export(model, example, mode), model) for mode in (True, False))
    finally:
        model.train(was_training)
    weights = {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_modules()}
    segments, train_parts, refined = cut(training.ops, weights, target_blocks)
    graphs = {
        "training": (training, train_parts),
        "evaluation": (evaluation, cut_alike(evaluation.ops, segments, refined)),
    }
    flows = {mode: _flow(graph, parts) for mode, (graph, parts) in graphs.items()}
    for mode, (graph, parts) in graphs.items():
        _check_writes(graph, parts, flows[mode])
    _check_holders(flows["training"], flows["evaluation"])
    device = next((t.device for t in training.tensors.values()), torch.device("cpu"))
    blocks: dict[str, GraphBlock] = {}
    for i, segment in enumerate(segments):
        blocks[_block_name(segment, blocks)] = _block(i, len(segments), graphs, flows, device, model)
    return nn.Sequential(OrderedDict(blocks))


def _block(
    i: int,
    count: int,
    graphs: dict[str, tuple[_Graph, list[list[fx.Node]]]],
    flows: dict[str, _Flow],
    device: torch.device,
    source: nn.Module,
) -> GraphBlock:
    """Segment ``i`` of ``count`` as a block, its graphs in both modes."""
    holds = sorted({name for flow in flows.values() for name in flow.holds[i]})
    made = {}
    for mode, (graph, parts) in graphs.items():
        takes: list[Value] = list(graph.inputs) if i == 0 else flows[mode].live[i]
        gives = graph.outputs if i == count - 1 else flows[mode].live[i + 1]
        made[mode] = _block_graph(graph, parts[i], holds=holds, takes=takes, gives=gives)
    training = graphs["training"][0]
    tensors = {**graphs["evaluation"][0].tensors, **training.tensors}
    return GraphBlock(
        held={name: tensors[name] for name in holds},
        transient=training.constants | graphs["evaluation"][0].constants,
        training=made["training"],
        evaluation=made["evaluation"],
        out_spec=training.out_spec if i == count - 1 else None,
        keywords=tuple(training.keywords) if i == 0 else (),
        device=device,
        source=source,
    )


def _block_name(segment: Segment, taken: dict[str, GraphBlock]) -> str:
    """The segment's submodule as a name, numbered where one repeats or would shadow ``nn.Sequential``'s own."""
    base = segment.key.replace(".", "_") or "ops"
    name, k = base, 1
    while name in taken or hasattr(nn.Sequential, name):
        k += 1
        name = f"{base}_{k}"
    return name
