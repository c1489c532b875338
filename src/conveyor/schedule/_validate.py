"""Check a schedule before it runs: complete, causal, matched, deadlock-free and within its memory bound.

Example:
    >>> from conveyor.schedule import flush
    >>> validate(flush(stages=4, microbatches=8), max_stashed=4).peak_stashed
    [4, 3, 2, 1]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from conveyor.schedule._actions import Action, Op
from conveyor.schedule._grid import action_grid
from conveyor.schedule._schedule import Schedule
from conveyor.schedule._simulate import ScheduleError, SimResult, simulate

__all__ = ["ScheduleError", "validate"]


def validate(schedule: Schedule, max_stashed: int | Sequence[int] | None = None) -> SimResult:
    """Raise :class:`ScheduleError` unless ``schedule`` can run as written.

    Checks that every stage runs the forward of every microbatch exactly once (and, in a training
    schedule, its backward once, after the forward); that every forward receives its input from the
    previous stage and sends its output to the next, and every backward likewise for gradients; that in a
    training schedule every ``STEP`` follows a ``REDUCE``, every worker ends with a ``STEP``, and the
    replicas of a stage reduce equally often; by simulating it with unit times, that every send is received
    in order and no worker waits forever; and that no forward asks for a weight version its worker has not
    made yet. Errors show the workers' actions with the offending one marked.

    Args:
        schedule: the action lists to check.
        max_stashed: the most activations a worker may hold for a pending backward (one number for
            every worker, or one per worker); ``None`` skips the check.

    Returns:
        The unit-time simulation, whose ``peak_stashed`` gives the stash each worker needs.
    """
    if len(schedule.actions) != len(schedule.worker_stage):
        raise ScheduleError(
            f"{len(schedule.actions)} action lists for {len(schedule.worker_stage)} workers: give one per worker"
        )
    bad = [s for s in schedule.worker_stage if not 0 <= s < schedule.stages]
    if bad:
        raise ScheduleError(f"worker stage {bad[0]} is outside 0..{schedule.stages - 1}")
    training = any(a.op is Op.BACKWARD for acts in schedule.actions for a in acts)
    for stage in range(schedule.stages):
        _check_stage(schedule, stage, training)
    for w, acts in enumerate(schedule.actions):
        _check_worker(schedule, w, acts, training)
    result = simulate(schedule, forward_s=1.0, backward_s=1.0)
    if max_stashed is not None:
        limits = [max_stashed] * schedule.workers if isinstance(max_stashed, int) else list(max_stashed)
        for w, (peak, limit) in enumerate(zip(result.peak_stashed, limits, strict=True)):
            if peak > limit:
                raise ScheduleError(f"worker {w} stashes {peak} activations at once, more than its bound {limit}")
    return result


def _check_stage(schedule: Schedule, stage: int, training: bool) -> None:
    workers = [w for w, s in enumerate(schedule.worker_stage) if s == stage]
    if not workers:
        raise ScheduleError(f"no worker runs stage {stage}")
    ops = [Op.FORWARD, Op.BACKWARD] if training else [Op.FORWARD]
    for op in ops:
        counts = Counter(a.microbatch for w in workers for a in schedule.actions[w] if a.op is op)
        for mb in range(schedule.microbatches):
            if counts[mb] != 1:
                raise ScheduleError(
                    f"stage {stage} runs {op.name.lower()} of microbatch {mb} {counts[mb]} times; it must run once"
                )
        extra = {mb for mb in counts if mb is not None} - set(range(schedule.microbatches))
        if extra:
            raise ScheduleError(f"stage {stage} runs microbatch {min(extra)}, outside 0..{schedule.microbatches - 1}")
    reduces = {w: sum(a.op is Op.REDUCE_GRAD for a in schedule.actions[w]) for w in workers}
    if len(set(reduces.values())) > 1:
        raise ScheduleError(
            f"the replicas of stage {stage} reduce a different number of times ({reduces}): every replica must "
            "join every all-reduce of its stage"
        )


def _check_worker(schedule: Schedule, w: int, acts: Sequence[Action], training: bool) -> None:
    stage, last = schedule.worker_stage[w], schedule.stages - 1

    def fail(i: int, why: str) -> ScheduleError:
        return ScheduleError(
            f"worker {w} (stage {stage}), action {i} {acts[i]}: {why}\n" + action_grid(schedule, {w: i})
        )

    unmade = schedule.unmade_version(w)
    if unmade is not None:
        made = sum(a.op is Op.STEP for a in acts[:unmade])
        raise fail(unmade, f"uses weight version {acts[unmade].version}, but only versions 0..{made} exist yet")
    seen: set[Action] = set()
    reduced = False
    for i, a in enumerate(acts):
        if a.op.is_send or a.op.is_recv:
            if a.peer is None or not 0 <= a.peer < schedule.workers:
                raise fail(i, f"peer must be a worker in 0..{schedule.workers - 1}")
            forward_flow = a.op in (Op.SEND_ACTIVATION, Op.RECV_GRAD)
            want = stage + 1 if forward_flow else stage - 1
            if schedule.worker_stage[a.peer] != want:
                raise fail(i, f"its peer must run stage {want}, not {schedule.worker_stage[a.peer]}")
        missing = [n for n in _prerequisites(a, stage, last) if n not in seen]
        if missing:
            raise fail(i, f"comes before {_describe(missing[0])} it depends on")
        if a.op is Op.STEP and not reduced:
            raise fail(i, "an optimizer step must follow a REDUCE of the gradients it applies")
        reduced = (reduced or a.op is Op.REDUCE_GRAD) and a.op is not Op.STEP
        seen.add(Action(a.op, a.microbatch))  # its peer and version do not matter for 'has this happened'
    if training and (not acts or acts[-1].op is not Op.STEP):
        raise ScheduleError(f"worker {w}: a training schedule must end with an optimizer step (STEP)")


def _prerequisites(a: Action, stage: int, last: int) -> list[Action]:
    mb = a.microbatch
    if a.op is Op.FORWARD:
        return [Action(Op.RECV_ACTIVATION, mb)] if stage > 0 else []
    if a.op is Op.SEND_ACTIVATION:
        return [Action(Op.FORWARD, mb)]
    if a.op is Op.BACKWARD:
        return [Action(Op.FORWARD, mb)] + ([Action(Op.RECV_GRAD, mb)] if stage < last else [])
    if a.op is Op.SEND_GRAD:
        return [Action(Op.BACKWARD, mb)]
    return []


def _describe(a: Action) -> str:
    return f"the {a.op.name.lower().replace('_', ' ')} of microbatch {a.microbatch}"
