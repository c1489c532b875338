"""The scheduling policies by Gavel's names, and :func:`allocate` to run one on a ``Problem``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from conveyor.cluster._policy_baselines import fifo, fifo_perf, gandiva, isolated
from conveyor.cluster._policy_cost import max_sum_throughput_perf, max_throughput_per_dollar, min_cost
from conveyor.cluster._policy_fairness import (
    max_min_fairness,
    max_min_fairness_packing,
    max_min_fairness_perf,
    max_min_fairness_water_filling,
    max_min_fairness_water_filling_perf,
)
from conveyor.cluster._policy_time import (
    finish_time_fairness,
    finish_time_fairness_perf,
    min_total_duration,
    min_total_duration_perf,
)
from conveyor.cluster._problem import Allocation, Problem
from conveyor.errors import InputError

__all__ = ["SCHEDULING_POLICIES", "allocate"]

SCHEDULING_POLICIES: dict[str, Callable[[Problem], Allocation]] = {
    "max_min_fairness": max_min_fairness,
    "max_min_fairness_perf": max_min_fairness_perf,
    "max_min_fairness_packing": max_min_fairness_packing,
    "max_min_fairness_water_filling": max_min_fairness_water_filling,
    "max_min_fairness_water_filling_perf": max_min_fairness_water_filling_perf,
    "finish_time_fairness": finish_time_fairness,
    "finish_time_fairness_perf": finish_time_fairness_perf,
    "min_total_duration": min_total_duration,
    "min_total_duration_perf": min_total_duration_perf,
    "max_sum_throughput_perf": max_sum_throughput_perf,
    "max_throughput_per_dollar": max_throughput_per_dollar,
    "min_cost": min_cost,
    "fifo": fifo,
    "fifo_perf": fifo_perf,
    "gandiva": gandiva,
    "isolated": isolated,
}
"""Every policy by name: ``*_perf`` ones see each job's throughput on each type (heterogeneity-aware), the
others stand in for schedulers that do not; ``*_packing`` and ``gandiva`` may put two jobs on one device."""


def allocate(name: str, problem: Problem) -> Allocation:
    """Run policy ``name`` (a key of :data:`SCHEDULING_POLICIES`) on ``problem``.

    Args:
        name: the policy, e.g. ``"max_min_fairness_perf"``.
        problem: the jobs and the cluster at this instant.

    Returns:
        Each combination's share of time on each device type (an empty allocation for a problem without jobs),
        with notes such as SLOs that cannot be met.

    Raises:
        ValueError: an unknown ``name``, or a problem the policy cannot take (the message says what to change).

    Example:
        >>> p = Problem((10, 11, 12), ("v100", "k80"), [[4.0, 1.0], [2.0, 1.0], [2.0, 1.0]], [1, 1, 1], [1, 1])
        >>> allocate("max_min_fairness_perf", p).effective_throughputs(p).round(4).tolist()  # 12/17 of 2.5, 1.5
        [1.7647, 1.0588, 1.0588]
        >>> allocate("fifo", Problem((), ("v100",), np.zeros((0, 1)), [], [4])).fractions.shape
        (0, 1)
    """
    policy = SCHEDULING_POLICIES.get(name)
    if policy is None:
        raise InputError(f"unknown policy {name!r}; choose one of: {', '.join(SCHEDULING_POLICIES)}")
    if problem.jobs == 0:
        return Allocation((), np.zeros((0, len(problem.device_types))))
    return policy(problem)
