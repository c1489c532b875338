"""The cut of each step's batch into chunks, as a flexible pipeline's run recorded it (its sizes follow the
replicas' measured speeds), for single-process references that run the same chunks."""

from typing import Any


def cuts_of(records: list[dict[str, Any]]) -> list[list[int]]:
    """Each step's chunk sizes, from the first stage's records (every replica of it records the same cut)."""
    steps = sorted({r["step"] for r in records})
    cuts = [[r["cut"] for r in records if r["step"] == step and r["stage"] == 0] for step in steps]
    assert all(len({tuple(c) for c in cut}) == 1 for cut in cuts), "the replicas cut a batch differently"
    return [cut[0] for cut in cuts]
