"""Per-layer profiles: what the planner needs to know about a model, saved as JSON with units.

A :class:`Profile` lists a model's layers in an order where every edge points forward (a topological
order), each with its forward and backward time, the bytes of its output activation and of its
parameters, and the graph's edges. A chain has the edges ``i -> i + 1``; a graph with branches or
residual connections has more, and cutting it after position ``i`` sends every tensor produced at or
before ``i`` and consumed after it (:meth:`Profile.cut_bytes`).

Profiles come from the original PipeDream profiler's ``graph.txt`` files (:func:`read_graph_txt`) or
from Conveyor's own JSON (:meth:`Profile.save` / :meth:`Profile.load`).

Example:
    >>> p = Profile.chain("toy", forward_s=[1e-3, 2e-3], backward_s=[2e-3, 4e-3], output_bytes=[10, 20],
    ...                   param_bytes=[100, 0])
    >>> p.cut_bytes(0), round(p.compute_s(0, 2), 6)
    (10, 0.009)
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from pathlib import Path

from conveyor.errors import InputError

__all__ = ["Layer", "Profile", "ProfileError", "read_graph_txt"]


class ProfileError(InputError):
    """A profile that cannot be read or does not describe a valid layer graph."""


@dataclass(frozen=True)
class Layer:
    """One profiled layer.

    Attributes:
        name: the layer's name (a block name, or a graph node id).
        description: what the layer is (its module's repr).
        forward_s: forward time of one minibatch, seconds.
        backward_s: backward time of one minibatch, seconds.
        output_bytes: bytes of the layer's output activation for one minibatch.
        param_bytes: bytes of the layer's parameters.
        saved_bytes: bytes autograd saves for the backward of one minibatch (0: not measured; PipeDream's
            graph.txt does not record it).
        optimizer_bytes: bytes of the optimizer's state for the layer's parameters (0: not measured).
        step_s: time of one optimizer step on the layer's parameters, seconds (0: not measured).
    """

    name: str
    description: str
    forward_s: float
    backward_s: float
    output_bytes: int
    param_bytes: int
    saved_bytes: int = 0
    optimizer_bytes: int = 0
    step_s: float = 0.0


@dataclass(frozen=True)
class Profile:
    """A model's layers in topological order, with the edges between them.

    Attributes:
        model: a name for the model.
        layers: the layers; every edge goes from an earlier to a later one.
        edges: ``(producer, consumer)`` positions in ``layers``.
        batch_size: the minibatch size the times and activation sizes are for, if known.
        variants: the same model measured at other batch sizes (same layers and edges), for planners that
            choose the microbatch size; see :meth:`at` and :attr:`batch_sizes`.
    """

    model: str
    layers: tuple[Layer, ...]
    edges: tuple[tuple[int, int], ...]
    batch_size: int | None = None
    variants: tuple[Profile, ...] = ()

    def __post_init__(self) -> None:
        if not self.layers:
            raise ProfileError(f"profile {self.model!r} has no layers")
        n = len(self.layers)
        for a, b in self.edges:
            if not (0 <= a < b < n):
                raise ProfileError(
                    f"edge {a} -> {b} of profile {self.model!r} does not point forward between 0 and {n - 1}: "
                    "layers must be listed in topological order"
                )
        for layer in self.layers:
            values = (
                layer.forward_s,
                layer.backward_s,
                layer.output_bytes,
                layer.param_bytes,
                layer.saved_bytes,
                layer.optimizer_bytes,
                layer.step_s,
            )
            if any(v < 0 for v in values):
                raise ProfileError(f"layer {layer.name!r} of profile {self.model!r} has a negative time or size")
        for v in self.variants:
            if v.batch_size is None or len(v.layers) != n or v.edges != self.edges or v.variants:
                raise ProfileError(
                    f"a variant of profile {self.model!r} must have a batch size, the same {n} layers and edges, "
                    "and no variants of its own"
                )
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ProfileError(f"profile {self.model!r} lists a batch size twice: {self.batch_sizes}")

    @property
    def batch_sizes(self) -> list[int | None]:
        """The batch sizes this profile holds measurements for, its own first."""
        return [self.batch_size, *(v.batch_size for v in self.variants)]

    def at(self, batch_size: int) -> Profile:
        """The profile measured at ``batch_size`` (this one or a variant)."""
        for p in (self, *self.variants):
            if p.batch_size == batch_size:
                return p if p is not self else replace(self, variants=())
        raise ProfileError(f"profile {self.model!r} has no measurements at batch size {batch_size}: {self.batch_sizes}")

    @cached_property
    def _crossing(self) -> tuple[int, ...]:
        """Bytes crossing the cut after each position: each producer counted once per cut it spans."""
        crossing = [0] * len(self.layers)
        spans: dict[int, int] = {}
        for a, b in self.edges:
            spans[a] = max(spans.get(a, a), b)
        for a, last in spans.items():
            for cut in range(a, last):
                crossing[cut] += self.layers[a].output_bytes
        return tuple(crossing)

    @cached_property
    def _compute_prefix(self) -> tuple[float, ...]:
        return tuple(itertools.accumulate((lay.forward_s + lay.backward_s for lay in self.layers), initial=0.0))

    @cached_property
    def _param_prefix(self) -> tuple[int, ...]:
        return tuple(itertools.accumulate((lay.param_bytes for lay in self.layers), initial=0))

    @classmethod
    def chain(
        cls,
        model: str,
        forward_s: Sequence[float],
        backward_s: Sequence[float],
        output_bytes: Sequence[int],
        param_bytes: Sequence[int],
        batch_size: int | None = None,
    ) -> Profile:
        """A profile of a plain chain of layers named ``0, 1, ...``."""
        layers = tuple(
            Layer(str(i), "", f, b, int(a), int(w))
            for i, (f, b, a, w) in enumerate(zip(forward_s, backward_s, output_bytes, param_bytes, strict=True))
        )
        return cls(model, layers, tuple((i, i + 1) for i in range(len(layers) - 1)), batch_size)

    def __len__(self) -> int:
        return len(self.layers)

    def reordered(self, order: Sequence[int]) -> Profile:
        """The same graph with layer ``order[k]`` at position ``k`` (another topological order).

        Raises:
            ProfileError: ``order`` is not a permutation of the positions, or an edge would point backwards.
        """
        if sorted(order) != list(range(len(self.layers))):
            raise ProfileError(f"{list(order)[:8]}... is not an order of the {len(self.layers)} layers of {self.model}")
        where = {old: new for new, old in enumerate(order)}
        return replace(
            self,
            layers=tuple(self.layers[i] for i in order),
            edges=tuple(sorted((where[a], where[b]) for a, b in self.edges)),
            variants=tuple(v.reordered(order) for v in self.variants),
        )

    def cut_bytes(self, after: int) -> int:
        """Bytes sent forward (and, as gradients, back) when the model is cut after position ``after``."""
        return self._crossing[after]

    def compute_s(self, first: int, stop: int) -> float:
        """Forward plus backward time of layers ``[first, stop)`` on one worker."""
        return self._compute_prefix[stop] - self._compute_prefix[first]

    def param_bytes(self, first: int, stop: int) -> int:
        """Parameter bytes of layers ``[first, stop)``."""
        return self._param_prefix[stop] - self._param_prefix[first]

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.model,
                "batch_size": self.batch_size,
                "units": {
                    "forward_s": "s",
                    "backward_s": "s",
                    "output_bytes": "B",
                    "param_bytes": "B",
                    "saved_bytes": "B",
                    "optimizer_bytes": "B",
                    "step_s": "s",
                },
                "layers": [asdict(layer) for layer in self.layers],
                "edges": [list(e) for e in self.edges],
                "variants": [
                    {"batch_size": v.batch_size, "layers": [asdict(layer) for layer in v.layers]} for v in self.variants
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> Profile:
        try:
            d = json.loads(text)
            edges = tuple((a, b) for a, b in d["edges"])
            variants = tuple(
                cls(d["model"], tuple(Layer(**lay) for lay in v["layers"]), edges, v["batch_size"])
                for v in d.get("variants", [])
            )
            layers = tuple(Layer(**layer) for layer in d["layers"])
            return cls(d["model"], layers, edges, d.get("batch_size"), variants)
        except ProfileError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ProfileError(f"{source} is not a Conveyor profile ({type(exc).__name__}: {exc})") from exc

    def save(self, path: str | os.PathLike[str]) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        """Read a profile: Conveyor's JSON, or PipeDream's ``graph.txt`` (or a folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "graph.txt"
        if not path.is_file():
            raise ProfileError(f"no profile at {path}: give a profile JSON or a PipeDream graph.txt")
        text = path.read_text()
        if text.lstrip().startswith("{"):
            return cls.from_json(text, str(path))
        return read_graph_txt(path)


_NODE = re.compile(r"^(node\d+) -- (.*) -- (forward_compute_time=.*)$")
_EDGE = re.compile(r"^\s+(node\d+) -- (node\d+)\s*$")


def read_graph_txt(path: str | os.PathLike[str], model: str | None = None) -> Profile:
    """Read a PipeDream ``graph.txt``: node lines with times in ms and sizes in bytes, then edge lines.

    The nodes are put in a topological order (ties broken by node number). Input nodes (``Input...``
    nodes without producers) are dropped, as PipeDream's optimizer drops them: the data loader hands every
    stage its input, so reading it takes no stage's time (their profiled time, 18 ms of VGG-16's and 636 ms
    of AlexNet's, is the loader's) and no cut carries it. So are ``__getitem__`` nodes that nothing consumes
    (GNMT's unused outputs), as PipeDream's optimizer also drops them.

    Raises:
        ProfileError: a line is neither a node nor an edge, a value is missing, or the graph has a cycle.
    """
    path = Path(path)
    nodes: dict[str, Layer] = {}
    edges: list[tuple[str, str]] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if m := _NODE.match(line):
            fields = dict(kv.split("=", 1) for kv in m.group(3).split(", "))
            try:
                nodes[m.group(1)] = Layer(
                    name=m.group(1),
                    description=m.group(2),
                    forward_s=float(fields["forward_compute_time"]) / 1e3,
                    backward_s=float(fields["backward_compute_time"]) / 1e3,
                    output_bytes=_bytes(fields["activation_size"]),
                    param_bytes=int(float(fields["parameter_size"])),
                )
            except KeyError as exc:
                raise ProfileError(f"{path}:{number}: node line lacks {exc}") from exc
            except ValueError as exc:
                raise ProfileError(f"{path}:{number}: node line has a value that is not a number ({exc})") from exc
        elif m := _EDGE.match(line):
            edges.append((m.group(1), m.group(2)))
        else:
            raise ProfileError(f"{path}:{number}: neither a node nor an edge line: {line[:80]!r}")
    unknown = {n for e in edges for n in e} - set(nodes)
    if unknown:
        raise ProfileError(f"{path}: edges name nodes that are not defined: {sorted(unknown)[:3]}")
    consumers, producers = {b for _, b in edges}, {a for a, _ in edges}
    dropped = {n for n, layer in nodes.items() if layer.description.startswith("Input") and n not in consumers}
    dropped |= {n for n, layer in nodes.items() if layer.description.startswith("__getitem__") and n not in producers}
    nodes = {n: layer for n, layer in nodes.items() if n not in dropped}
    edges = [(a, b) for a, b in edges if a not in dropped and b not in dropped]
    order = _topological_order(list(nodes), edges, path)
    position = {name: i for i, name in enumerate(order)}
    return Profile(
        model or path.parent.name,
        tuple(nodes[name] for name in order),
        tuple(sorted({(position[a], position[b]) for a, b in edges})),
    )


def _bytes(value: str) -> int:
    """A size, or the total of a layer with several outputs, written ``[a; b; c]``."""
    return int(sum(float(v) for v in value.strip("[]").split(";")))


def _topological_order(names: list[str], edges: list[tuple[str, str]], source: Path) -> list[str]:
    indegree = dict.fromkeys(names, 0)
    consumers: dict[str, list[str]] = {n: [] for n in names}
    for a, b in edges:
        indegree[b] += 1
        consumers[a].append(b)
    number = {n: int(n[4:]) for n in names}
    ready = sorted((n for n, d in indegree.items() if d == 0), key=number.__getitem__)
    order = []
    while ready:
        n = ready.pop(0)
        order.append(n)
        for c in consumers[n]:
            indegree[c] -= 1
            if indegree[c] == 0:
                ready.append(c)
                ready.sort(key=number.__getitem__)
    if len(order) != len(names):
        raise ProfileError(f"{source}: the graph has a cycle; a profile must be a DAG")
    return order
