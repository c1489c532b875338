"""Tiers and AgileML's three stages: which workers compute, which own the training state, where its backup is.

A job's workers are **reliable** (on-demand: never revoked; the first hosts the c10d store and coordinates)
or **transient** (spot: revoked at any time, in bulk). The training state is the weights and the optimizer's
state. The weights are replicated on every computing worker (data parallelism); the optimizer's state is
split into contiguous shards of the flattened parameters, each held by one **owner**, which applies the
update to its shard and sends the new weights of the shard to every computing worker (as Proteus' parameter
servers do). Which workers own what follows the ratio ``r = transient / reliable`` (Proteus, Harlap et al.,
EuroSys'17, section 4.2):

- **stage 1** (``r <= sync_max``): reliable workers compute and own every shard. The state survives any
  revocation with nothing redone beyond the step in flight, but the owners' update and sending of every
  shard is on every step's critical path, a bottleneck as transient workers are added.
- **stage 2** (``sync_max < r < backup_only_min``): every worker computes; transient workers own the shards
  (the update is spread); each owner sends its shard to the reliable tier every ``backup_every`` steps,
  asynchronously (a backup lags the run by at most ``2 * backup_every`` steps). An owner revoked with notice
  hands its shard over; one revoked without notice costs a return to the last complete backup.
- **stage 3** (``r >= backup_only_min``): as stage 2, but reliable workers only keep backups (their compute
  is small beside the transient tier's, and their link is kept for the backups).

Example:
    >>> agile_stage(transient=1, reliable=1), agile_stage(5, 2), agile_stage(12, 1)
    (1, 2, 3)
    >>> roles([0, 1, 2, 3, 4], reliable=[0], stage=2)
    Roles(stage=2, compute=(0, 1, 2, 3, 4), owners=(1, 2, 3, 4))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from conveyor.errors import InputError

__all__ = ["BACKUP_ONLY_MIN", "SYNC_MAX", "Roles", "agile_stage", "roles", "shard_bounds"]

# Ratios (transient / reliable) at which the stage changes, from `conveyor bench elastic --epochs 0
# --stage-workers 2,3,4,6` (docs/benchmarks/elastic.md, "AgileML's stages"): stage 1 within 1% of stage 2's
# samples/s up to 2, stage 3 the fastest from 3.
SYNC_MAX = 2.0
BACKUP_ONLY_MIN = 3.0


def agile_stage(
    transient: int, reliable: int, sync_max: float = SYNC_MAX, backup_only_min: float = BACKUP_ONLY_MIN
) -> int:
    """AgileML's stage (1, 2 or 3) for ``transient`` and ``reliable`` workers (see the module docstring)."""
    if reliable < 1:
        raise InputError("an elastic job needs at least one reliable worker (--reliable K, K >= 1)")
    if not 0 <= sync_max <= backup_only_min:
        raise InputError(
            f"stage thresholds must satisfy 0 <= sync_max <= backup_only_min, got {sync_max}, {backup_only_min}"
        )
    ratio = transient / reliable
    return 1 if ratio <= sync_max else (3 if ratio >= backup_only_min else 2)


@dataclass(frozen=True)
class Roles:
    """What the members of one generation do: AgileML's stage, who computes, who owns the shards (in order)."""

    stage: int
    compute: tuple[int, ...]
    owners: tuple[int, ...]


def roles(
    members: Sequence[int],
    reliable: Sequence[int],
    stage: int | None = None,
    sync_max: float = SYNC_MAX,
    backup_only_min: float = BACKUP_ONLY_MIN,
) -> Roles:
    """The roles of ``members`` (worker ids, sorted), ``reliable`` of them reliable, in ``stage`` (default: the
    stage the ratio gives)."""
    members = sorted(members)
    steady = [w for w in members if w in reliable]
    transient = [w for w in members if w not in reliable]
    if not steady:
        raise InputError("no reliable worker is left: the reliable tier must outlive the job")
    stage = agile_stage(len(transient), len(steady), sync_max, backup_only_min) if stage is None else stage
    if not transient:  # nothing is transient: the reliable tier does everything
        stage = 1
    if stage == 1:
        return Roles(1, tuple(members), tuple(steady))
    return Roles(stage, tuple(members if stage == 2 else transient), tuple(transient))


def shard_bounds(numel: int, owners: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` shards of ``numel`` elements for ``owners`` owners, as even as can be.

    Example:
        >>> shard_bounds(10, 3)
        [(0, 4), (4, 7), (7, 10)]
    """
    base, extra = divmod(numel, owners)
    bounds, start = [], 0
    for i in range(owners):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds
