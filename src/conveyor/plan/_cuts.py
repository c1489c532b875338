"""Where a layer graph can be cut: the sets of layers that may come before a cut, as PipeDream's optimizer finds them.

A stage boundary of a pipeline over a graph is a *down-set*: a set of layers that holds every producer of
each of its layers. PipeDream's optimizer (msr-fiddle/pipedream, ``graph/graph.py``, its "antichain DAG")
starts from the first source's down-set and grows a down-set ``D`` by one layer ``y`` outside it that
consumes something of ``D``, together with all of ``y``'s producers: ``D | below(y)``. The planner searches
those down-sets (plus the empty set before the first stage), in the order of their size; a stage is the
difference of two nested ones. The bytes crossing a cut are the outputs of the layers inside with a
consumer outside, each once (PipeDream's optimizer also counts producers whose consumers all lie inside
when they feed another of the antichain's branches; this counts each tensor that crosses exactly once).

On a chain the down-sets are the prefixes, and the search is the same as over layer positions. A graph
can have very many down-sets (Inception-v3's profile has 221,564); above ``limit`` the planner cuts along
the profile's topological order instead, and says so in :attr:`Cuts.why_not_graph`.

Example:
    >>> from conveyor.plan._profiles import Layer, Profile
    >>> layer = Layer("x", "", 1.0, 1.0, 8, 0)
    >>> diamond = Profile("diamond", (layer,) * 4, ((0, 1), (0, 2), (1, 3), (2, 3)))
    >>> [sorted(s) for s in cuts_of(diamond).sets]  # either branch may end the first stage
    [[], [0], [0, 1], [0, 2], [0, 1, 2], [0, 1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from conveyor.plan._profiles import Profile

__all__ = ["Cuts", "cuts_of"]

STATE_LIMIT = 1000


@dataclass(frozen=True)
class Cuts:
    """The boundaries a plan may place stages at, the empty set first and every layer last.

    Attributes:
        sets: each boundary's layers (positions in the profile), nested sets in size order.
        why_not_graph: why the search cuts along the profile's order instead of the graph's down-sets
            ("" when it does not, or when the profile is a chain).
    """

    sets: tuple[frozenset[int], ...]
    why_not_graph: str = ""

    def prefix(self, values: Sequence[float]) -> np.ndarray:
        """``[T + 1]``: the total of per-layer ``values`` over each boundary's layers."""
        return self._membership() @ np.asarray(values, dtype=np.float64)

    def span(self, values: Sequence[float]) -> np.ndarray:
        """``[a, b]``: the total over the layers between boundaries ``a`` and ``b`` (``nan`` unless ``a``'s
        set lies strictly inside ``b``'s)."""
        prefix = self.prefix(values)
        return np.where(self.nested(), prefix[None, :] - prefix[:, None], np.nan)

    def nested(self) -> np.ndarray:
        """``[a, b]``: boundary ``a``'s set lies strictly inside boundary ``b``'s."""
        member = self._membership()
        size = member.sum(axis=1)
        shared = member @ member.T  # [a, b]: layers in both
        cuts: np.ndarray = (shared == size[:, None]) & (size[:, None] < size[None, :])
        return cuts

    def crossing(self, profile: Profile) -> np.ndarray:
        """``[T + 1]``: bytes of the outputs of each boundary's layers that a layer outside consumes."""
        member = self._membership().astype(bool)
        crosses = np.zeros_like(member)
        for a, b in profile.edges:
            crosses[:, a] |= member[:, a] & ~member[:, b]
        return crosses @ np.array([lay.output_bytes for lay in profile.layers], dtype=np.float64)

    def layers(self, a: int, b: int) -> list[int]:
        """The layers between boundaries ``a`` and ``b``, in the profile's order."""
        return sorted(self.sets[b] - self.sets[a])

    def _membership(self) -> np.ndarray:
        n = max(self.sets[-1]) + 1
        member = np.zeros((len(self.sets), n))
        for row, layers in enumerate(self.sets):
            member[row, list(layers)] = 1.0
        return member


def cuts_of(profile: Profile, limit: int = STATE_LIMIT) -> Cuts:
    """The boundaries the planner searches for ``profile`` (see the module docstring)."""
    n = len(profile)
    prefixes = tuple(frozenset(range(k)) for k in range(n + 1))
    if profile.edges == tuple((i, i + 1) for i in range(n - 1)):
        return Cuts(prefixes)
    producers: list[set[int]] = [set() for _ in range(n)]
    consumers: list[set[int]] = [set() for _ in range(n)]
    for a, b in profile.edges:
        producers[b].add(a)
        consumers[a].add(b)
    below: list[frozenset[int]] = []  # below[y]: y and everything it depends on
    for y in range(n):  # layers are in topological order
        below.append(frozenset({y}).union(*(below[p] for p in producers[y])))
    first = below[0]
    found, queue = {first}, [first]
    while queue:
        down = queue.pop()
        for y in {c for x in down for c in consumers[x]} - down:
            grown = down | below[y]
            if grown not in found:
                found.add(grown)
                queue.append(grown)
                if len(found) > limit:
                    why = (
                        f"the graph of {profile.model} has more than {limit} down-sets to cut at; the plan cuts "
                        "along the profile's topological order instead"
                    )
                    return Cuts(prefixes, why)
    everything = frozenset(range(n))
    if everything not in found:  # a source no layer of the first's down-set leads to
        why = f"not every layer of {profile.model} is reached from its first source; cutting along its order"
        return Cuts(prefixes, why)
    return Cuts((frozenset(), *sorted(found, key=lambda s: (len(s), sorted(s)))))
