"""One block of a model split by :func:`~conveyor.runtime.split_model`: the tensors it holds, under the model's
own names, and its operations in training and in evaluation, each a graph ``(*held, *values in) -> values out``.

A graph is traced on one device; a block moved elsewhere runs a copy of it whose device arguments (``arange``'s,
``to``'s, export's metadata checks) name the new device, made once per device.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["GraphBlock", "view_base", "written_args"]


@dataclass(frozen=True)
class _Code:
    """A block's graphs: no state, so every copy of the block (a weight version, a replica) shares them."""

    training: fx.GraphModule
    evaluation: fx.GraphModule
    out_spec: Any  # the model's output structure (the last block's), else None
    keywords: tuple[str, ...]  # the first block's, traced on keyword arguments: its input mapping's names
    device: torch.device  # where the graphs were traced
    source: nn.Module | None  # the model split (its modules know how to initialise the tensors held)
    moved: dict[str, tuple[fx.GraphModule, fx.GraphModule]] = field(default_factory=dict, compare=False)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Code:
        return self

    def graphs(self, device: torch.device | None) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The training and evaluation graphs for ``device``."""
        if device is None or device == self.device:
            return self.training, self.evaluation
        if str(device) not in self.moved:
            self.moved[str(device)] = (_moved(self.training, device), _moved(self.evaluation, device))
        return self.moved[str(device)]


def _moved(graph: fx.GraphModule, device: torch.device) -> fx.GraphModule:
    """A copy of ``graph`` whose device arguments name ``device``."""
    moved = copy.deepcopy(graph)

    def retarget(value: Any) -> Any:
        return device if isinstance(value, torch.device) else value

    for node in moved.graph.nodes:
        node.args = pytree.tree_map(retarget, node.args)
        node.kwargs = pytree.tree_map(retarget, node.kwargs)
    moved.recompile()
    return moved


def _written_in_place(graph: fx.GraphModule, skip: int) -> frozenset[int]:
    """Which of ``graph``'s inputs after the first ``skip`` an operation writes in place, directly (``x += y``)
    or through a view of it (``x[:, :2] += y``)."""
    inputs = {node: i - skip for i, node in enumerate(graph.graph.find_nodes(op="placeholder")) if i >= skip}
    written = set()
    for node in graph.graph.nodes:
        for arg in written_args(node):
            base = view_base(arg)
            if base in inputs:
                written.add(inputs[base])
    return frozenset(written)


def written_args(node: fx.Node) -> list[fx.Node]:
    """The arguments an operation writes in place (its schema says which)."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    if schema is None:
        return []
    pairs = zip(node.args, schema.arguments, strict=False)
    return [
        a for a, spec in pairs if isinstance(a, fx.Node) and spec.alias_info is not None and spec.alias_info.is_write
    ]


def view_base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of (itself if it is none): followed through operations whose result aliases
    their first argument."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        schema = getattr(node.target, "_schema", None)
        returns = schema.returns if schema is not None else []
        if not returns or returns[0].alias_info is None or returns[0].alias_info.is_write:
            break
        node = node.args[0]
    return node


class GraphBlock(nn.Module):
    """A segment of a split model (see the module docstring). Its input is the values the blocks before it give
    on (a tuple, the one tensor alone, or for the first block of a model traced on keyword arguments, a
    mapping by name); so is its output, except the last block's, which is the model's own."""

    def __init__(
        self,
        *,
        held: dict[str, torch.Tensor],
        transient: set[str],
        training: fx.GraphModule,
        evaluation: fx.GraphModule,
        out_spec: Any = None,
        keywords: tuple[str, ...] = (),
        device: torch.device,
        source: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self._slots: list[tuple[nn.Module, str]] = []  # where each held tensor is, read at every call
        for name, tensor in held.items():
            path, _, attr = name.rpartition(".")
            holder = self._holder(path)
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(attr, tensor)
            else:  # a buffer; a constant the trace made is moved with the block but not saved
                holder.register_buffer(attr, tensor, persistent=name not in transient)
            self._slots.append((holder, attr))
        self._held_names = list(held)
        self._code = _Code(training, evaluation, out_spec, keywords, device, source)
        self._written = (_written_in_place(training, len(held)), _written_in_place(evaluation, len(held)))

    @property
    def output_spec(self) -> Any:
        """The structure of the model's output (``None`` on every block but the last)."""
        return self._code.out_spec

    @property
    def source(self) -> nn.Module | None:
        """The model this block was split from: the tensors it holds are that model's, by the same names."""
        return self._code.source

    def traced_outputs(self) -> list[Any]:
        """What the training graph gave for the example it was traced on: its flat outputs' fake values."""
        [output] = self._code.training.graph.find_nodes(op="output")
        return [getattr(a, "meta", {}).get("val") for a in output.args[0]]

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
        held = [getattr(module, attr) for module, attr in self._slots]
        if self._code.keywords and isinstance(values, Mapping):
            values = tuple(values[k] for k in self._code.keywords)
        values = values if isinstance(values, tuple) else (values,)
        written = self._written[0 if self.training else 1]
        if written:  # a value another stage sent is a leaf autograd cannot let an operation write: write a copy
            values = tuple(_writable(v) if i in written else v for i, v in enumerate(values))
        device = held[0].device if held else next((v.device for v in values if isinstance(v, torch.Tensor)), None)
        training, evaluation = self._code.graphs(device)
        out = (training if self.training else evaluation)(*held, *values)
        if self._code.out_spec is not None:
            return pytree.tree_unflatten(list(out), self._code.out_spec)
        return out[0] if len(out) == 1 else tuple(out)

    def __repr__(self) -> str:  # one line: profiles and plans describe each block by it
        ops = [_op_name(n.target) for n in self._code.training.graph.nodes if n.op == "call_function"]
        names = ", ".join(self._held_names) or "nothing"
        return f"GraphBlock({', '.join(dict.fromkeys(ops)) or 'no operation'}; holds {names})"


def _writable(value: Any) -> Any:
    leaf = isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad
    return value.clone() if leaf else value


def _op_name(target: Any) -> str:
    """``aten.linear.default`` -> ``linear``; a Python function by its name."""
    text = str(target)
    return text.split(".")[1] if text.startswith("aten.") else getattr(target, "__name__", text)
