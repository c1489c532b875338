"""Architecture matching (ModelKeeper, NSDI'23): align two operator graphs, pick a parent from a store of models."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from conveyor.errors import InputError
from conveyor.warmstart._graph import OpGraph, OpNode

__all__ = ["SIGNATURE_OPS", "Alignment", "Match", "ModelIndex", "align", "pair_score", "signature"]

EPSILON = 1e-3  # the gain of a matched pair beyond its similarity: parameterless ops only break ties


@dataclass
class Alignment:
    """How a child's layers map onto a parent's.

    Attributes:
        pairs: (parent name, child name) for each matched node with parameters, in the child's order; names are
            qualified module names (for a ``"Parameter"`` node, the module owning the parameter, the parameter named
            in the node's ``params``). Each child name appears at most once.
        score: the mean similarity over the child's parameterised nodes, in [0, 1] (1: every one matched, same shapes).
        coverage: the fraction of the child's parameter elements in nodes matched to a parent node of the same type.
    """

    pairs: list[tuple[str, str]] = field(default_factory=list)
    score: float = 0.0
    coverage: float = 0.0


def _overlap(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return math.prod(map(min, a, b)) if len(a) == len(b) else 0


def pair_score(p: OpNode, c: OpNode) -> float:
    r"""The similarity of parent node ``p`` and child node ``c``; -inf when they cannot pair.

    .. math::

        s(p, c) = \frac{\sum_k \prod_d \min(p_{k,d}, c_{k,d})}{\sum_k \max(|p_k|, |c_k|)}

    over the union of parameter names :math:`k` (a name missing on one side, or of another rank, overlaps 0),
    :math:`|p_k|` the elements of parameter :math:`k`: 1 for identical shapes, the fraction of overlapping
    elements otherwise. A parameterless pair of the same op scores 1; different ops cannot pair.

    Example:
        >>> lin = lambda o, i: OpNode("l", "Linear", {"weight": (o, i), "bias": (o,)})
        >>> pair_score(lin(4, 4), lin(4, 4)), pair_score(lin(2, 4), lin(4, 4))  # 8 + 2 of 16 + 4
        (1.0, 0.5)
        >>> pair_score(lin(4, 4), OpNode("c", "Conv2d", {"weight": (4, 4, 1, 1)}))
        -inf
    """
    if p.op != c.op:
        return -math.inf
    if not p.params and not c.params:
        return 1.0
    shared = sum(_overlap(p.params[k], c.params[k]) for k in p.params.keys() & c.params.keys())
    total = sum(
        max(math.prod(p.params[k]) if k in p.params else 0, math.prod(c.params[k]) if k in c.params else 0)
        for k in p.params.keys() | c.params.keys()
    )
    return shared / total if total else 1.0


def align(parent: OpGraph, child: OpGraph) -> Alignment:
    r"""Align ``child``'s nodes with ``parent``'s in topological order by dynamic programming.

    As in sequence alignment (a weighted longest common subsequence), with parent nodes :math:`p_1..p_n` and child
    nodes :math:`c_1..c_m` in topological order, :math:`D_{i,j}` the best gain aligning :math:`p_{i..n}` with
    :math:`c_{j..m}`:

    .. math::

        D_{i,j} = \max(D_{i+1,j},\; D_{i,j+1},\; D_{i+1,j+1} + g(p_i, c_j)), \qquad D_{n+1,j} = D_{i,m+1} = 0

        g(p, c) = s(p, c) + \epsilon \text{ if } op(p) = op(c) \text{ else } -\infty

    with :math:`s` from :func:`pair_score` and :math:`\epsilon = 10^{-3}`, so matched parameterless ops (ReLU, add,
    cat) only break ties and parameterised layers carry the score. Pairs are read from the front, a match preferred
    on ties, so an extra child layer is left unpaired after the shared ones. Then, over the child's parameterised
    nodes :math:`C_\theta` and the matched pairs :math:`M`:

    .. math::

        \text{score} = \frac{1}{|C_\theta|} \sum_{(p, c) \in M,\, c \in C_\theta} s(p, c), \qquad
        \text{coverage} = \frac{\sum_{(p, c) \in M,\, c \in C_\theta} |c|}{\sum_{c \in C_\theta} |c|}

    Args:
        parent: the trained model's graph.
        child: the new model's graph.

    Returns:
        The alignment (empty, score 0, when either graph has no parameterised nodes).

    Example:
        >>> from torch import nn
        >>> from conveyor.warmstart._graph import op_graph
        >>> # the parent's head Linear(8, 2) pairs with the child's head, not its Linear(8, 8) (which scores 18/72)
        >>> p = op_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> c = op_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> a = align(p, c)
        >>> a.pairs, round(a.score, 3), round(a.coverage, 3)
        ([('0', '0'), ('2', '4')], 0.667, 0.446)
    """
    n, m = len(parent.nodes), len(child.nodes)
    similarity = np.full((n, m), -np.inf)
    for i, p in enumerate(parent.nodes):
        for j, c in enumerate(child.nodes):
            if p.op == c.op:
                similarity[i, j] = pair_score(p, c)
    gain = similarity + EPSILON
    best = np.zeros((n + 1, m + 1))
    for i in range(n - 1, -1, -1):
        row, below, g = best[i], best[i + 1], gain[i]
        for j in range(m - 1, -1, -1):
            row[j] = max(below[j], row[j + 1], below[j + 1] + g[j])
    pairs: list[tuple[str, str]] = []
    matched: dict[int, float] = {}  # child index -> similarity
    paired: set[str] = set()  # child names already paired (a module called twice appears twice)
    i = j = 0
    while i < n and j < m:
        if gain[i, j] > -np.inf and best[i + 1, j + 1] + gain[i, j] >= best[i, j] - 1e-9:
            c = child.nodes[j]
            if c.params and c.name not in paired:
                pairs.append((parent.nodes[i].name, c.name))
                paired.add(c.name)
                matched[j] = float(similarity[i, j])
            i, j = i + 1, j + 1
        elif best[i + 1, j] >= best[i, j + 1]:
            i += 1
        else:
            j += 1
    layers = [j for j, c in enumerate(child.nodes) if c.params]
    if not layers or not any(p.params for p in parent.nodes):
        return Alignment()
    total = sum(child.nodes[j].size for j in layers)
    covered = sum(child.nodes[j].size for j in matched)
    score = sum(matched.values()) / len(layers)
    return Alignment(pairs, min(1.0, max(0.0, score)), covered / total if total else 0.0)


# The op types a signature counts (anything else counts as "other") and, for those with parameters, sizes.
SIGNATURE_OPS = (
    "Linear",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "LayerNorm",
    "Embedding",
    "Parameter",
    "ReLU",
    "GELU",
    "MaxPool2d",
    "Dropout",
    "add",
    "cat",
    "mul",
    "flatten",
    "relu",
    "scaled_dot_product_attention",
)
_SLOT = {op: i for i, op in enumerate(SIGNATURE_OPS)}
SIGNATURE_LENGTH = 2 * (len(SIGNATURE_OPS) + 1) + 2


def signature(g: OpGraph) -> np.ndarray:
    r"""A fixed-length vector summarising ``g`` cheaply, for shortlisting before alignment.

    Per op type in :data:`SIGNATURE_OPS` plus "other": the count of nodes, then :math:`\log(1 + \text{elements})`
    of its parameters; last the node count and :math:`\log(1 + \text{all elements})`. Similar architectures lie
    close in Euclidean distance.

    Example:
        >>> from torch import nn
        >>> from conveyor.warmstart._graph import op_graph
        >>> s = signature(op_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU())))
        >>> s.shape == (SIGNATURE_LENGTH,), float(s[_SLOT["Linear"]]), float(s[_SLOT["ReLU"]]), float(s[-2])
        (True, 1.0, 1.0, 2.0)
    """
    k = len(SIGNATURE_OPS) + 1
    counts, sizes = np.zeros(k), np.zeros(k)
    for node in g.nodes:
        slot = _SLOT.get(node.op, k - 1)
        counts[slot] += 1
        sizes[slot] += node.size
    return np.concatenate([counts, np.log1p(sizes), [len(g.nodes), math.log1p(g.size)]])


@dataclass
class Match:
    """The parent :meth:`ModelIndex.best` picked.

    Attributes:
        parent: the chosen model's id, ``None`` when there is none (see ``reason``).
        alignment: the parent's alignment with the child.
        ranking: ``(model id, alignment score, accuracy, blended rank)`` for each aligned candidate, best first.
        reason: why there is no parent, else ``""``.
    """

    parent: str | None
    alignment: Alignment | None = None
    ranking: list[tuple[str, float, float, float]] = field(default_factory=list)
    reason: str = ""


class ModelIndex:
    """Trained models' graphs, signatures and accuracies, to pick a warm-start parent for a new model.

    :meth:`best` shortlists the ``k`` stored models whose signatures lie nearest the child's (one vectorised NumPy
    distance over all of them), aligns only those, and ranks them by ``score * accuracy ** w``: with ``w = 0`` by
    architecture alone, with ``w = 1`` (the default) a parent with 0.9 of another's similarity wins when its accuracy
    is more than 1 / 0.9 (11% above) the other's.

    Example:
        >>> from torch import nn
        >>> from conveyor.warmstart._graph import op_graph
        >>> index = ModelIndex()
        >>> index.add("small", op_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))), 0.9)
        >>> index.add("conv", op_graph(nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU())), 0.95)
        >>> match = index.best(op_graph(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))))
        >>> match.parent, match.alignment.score, [r[0] for r in match.ranking]
        ('small', 1.0, ['small', 'conv'])
        >>> ModelIndex().best(op_graph(nn.Linear(2, 2))).reason
        'no stored models'
    """

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.graphs: list[OpGraph] = []
        self.accuracies: list[float] = []
        self._signatures: list[np.ndarray] = []
        self._matrix: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def add(self, model_id: str, graph: OpGraph, accuracy: float) -> None:
        """Store a trained model's graph and its accuracy (in [0, 1]).

        Raises:
            ValueError: the id is already stored, or the accuracy is outside [0, 1].
        """
        if model_id in self.ids:
            raise InputError(f"model {model_id!r} is already in the index")
        if not 0.0 <= accuracy <= 1.0:
            raise InputError(f"accuracy of {model_id!r} must lie in [0, 1], not {accuracy}")
        self.ids.append(model_id)
        self.graphs.append(graph)
        self.accuracies.append(float(accuracy))
        self._signatures.append(signature(graph))
        self._matrix = None

    def shortlist(self, child: OpGraph, k: int = 5) -> list[int]:
        """The indices of the ``k`` stored models whose signatures lie nearest ``child``'s, nearest first."""
        if self._matrix is None:
            self._matrix = np.stack(self._signatures) if self._signatures else np.zeros((0, SIGNATURE_LENGTH))
        distance = np.linalg.norm(self._matrix - signature(child), axis=1)
        k = min(k, len(distance))
        nearest = np.argpartition(distance, k - 1)[:k] if k < len(distance) else np.arange(len(distance))
        return [int(i) for i in nearest[np.argsort(distance[nearest], kind="stable")]]

    def best(self, child: OpGraph, k: int = 5, w: float = 1.0) -> Match:
        """Pick the parent for ``child``: shortlist ``k`` by signature, align them, rank by ``score * accuracy ** w``.

        Args:
            child: the new model's graph.
            k: how many candidates to align.
            w: the weight of accuracy in the rank (0: similarity alone).

        Returns:
            The match; ``parent`` is ``None``, with a one-line ``reason``, when nothing is stored, the child has no
            parameterised layers, or no candidate shares a layer with it.
        """
        if not self.ids:
            return Match(None, reason="no stored models")
        if not any(n.params for n in child.nodes):
            return Match(None, reason="the child graph has no parameterised layers")
        if k < 1:
            return Match(None, reason=f"k must be at least 1, not {k}")
        ranking: list[tuple[str, float, float, float, Alignment]] = []
        for i in self.shortlist(child, k):
            a = align(self.graphs[i], child)
            acc = self.accuracies[i]
            ranking.append((self.ids[i], a.score, acc, a.score * acc**w, a))
        ranking.sort(key=lambda r: -r[3])  # stable: equal ranks keep the signature order
        top = ranking[0]
        rows = [r[:4] for r in ranking]
        if top[1] <= 0.0:
            return Match(None, None, rows, reason=f"none of the {len(ranking)} nearest models shares a layer type")
        return Match(top[0], top[4], rows)
