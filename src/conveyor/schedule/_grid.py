"""The action grid that schedule errors show: one line per worker, the offending actions marked.

Example:
    >>> from conveyor.schedule import flush
    >>> print(action_grid(flush(2, 2), {1: 2}))
      worker 0 (stage 0): F0 SEND_F0>1 F1 SEND_F1>1 RECV_B0<1 B0 RECV_B1<1 B1 REDUCE STEP
      worker 1 (stage 1): RECV_F0<0 F0 >>B0<< SEND_B0>0 RECV_F1<0 F1 B1 SEND_B1>0 REDUCE STEP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from conveyor.schedule._schedule import Schedule

__all__ = ["action_grid"]

_MAX_WORKERS = 16


def action_grid(schedule: Schedule, marks: Mapping[int, int], context: int = 6) -> str:
    """Each worker's actions, with action ``marks[w]`` of worker ``w`` shown as ``>>action<<``.

    A line shows ``context`` actions either side of its mark (the first ``2 * context + 1`` when it has
    none); ``...`` stands for the ones left out.
    """
    lines = []
    for w, acts in enumerate(schedule.actions[:_MAX_WORKERS]):
        mark = marks.get(w)
        start = 0 if mark is None else max(0, mark - context)
        stop = min(len(acts), start + 2 * context + 1)
        shown = [f">>{a}<<" if i == mark else str(a) for i, a in enumerate(acts[start:stop], start)]
        line = ("... " if start else "") + " ".join(shown) + (" ..." if stop < len(acts) else "")
        lines.append(f"  worker {w} (stage {schedule.worker_stage[w]}): {line}")
    if schedule.workers > _MAX_WORKERS:
        lines.append(f"  ... and {schedule.workers - _MAX_WORKERS} more workers")
    return "\n".join(lines)
