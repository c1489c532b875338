"""``conveyor bench markets``' summary rows, goals and plot."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["GOALS", "goals", "median_rows", "plot"]

GOALS = {
    "deadline_rate": 0.99,  # every deadline policy meets its deadline from this share of starts or more
    "portfolio_vs_limit": 1.2,  # the portfolio's median cost per work over the physical limit, at most
    "portfolio_vs_uniform_progress": 0.9,  # ... over uniform progress's, at most (10% below)
    "moves_vs_best_static": 1.5,  # the best single-kind portfolio's median over the moves', at least
    "tributary_saving": (0.81, 0.86),  # Tributary's saving against on-demand (ATC'18), set beside ours
    "real_mode_error": 0.1,  # the simulator's cost and finish within 10% of the real run's
}
DEADLINE_POLICIES = ("spot-restart", "uniform-progress", "portfolio", "portfolio-moves")


def median_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (trace set, policy, discount, billing): the median and spread of cost per work over the
    starts, the share of starts that met the deadline, the median finish.

    Example:
        >>> r = lambda c, met: {"trace_set": "s", "policy": "p", "discount": 0.3, "billing": "per-second",
        ...     "cost_per_work": c, "limit_cost_per_work": 1.0, "deadline_met": met, "finish_h": 10.0}
        >>> row = median_rows([r(1.0, True), r(2.0, True), r(4.0, False)])[0]
        >>> row["median_cost_per_work"], row["deadline_rate"], row["vs_limit"]
        (2.0, 0.6666666666666666, 2.0)
    """
    groups: dict[tuple[str, str, float, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[(r["trace_set"], r["policy"], r["discount"], r["billing"])].append(r)
    out = []
    for (trace_set, policy, discount, billing), rs in groups.items():
        costs = [r["cost_per_work"] for r in rs]
        median = statistics.median(costs)
        out.append(
            {
                "trace_set": trace_set,
                "policy": policy,
                "discount": discount,
                "billing": billing,
                "starts": len(rs),
                "median_cost_per_work": median,
                "min_cost_per_work": min(costs),
                "max_cost_per_work": max(costs),
                "vs_limit": median / rs[0]["limit_cost_per_work"],
                "deadline_rate": sum(r["deadline_met"] for r in rs) / len(rs),
                "median_finish_h": statistics.median(r["finish_h"] for r in rs),
            }
        )
    return out


def _by(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["trace_set"], r["policy"]): r for r in rows}


def goals(
    results: Sequence[dict[str, Any]], sweep: Sequence[dict[str, Any]], real: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Each goal per trace set: the measured figure and whether it is met."""
    by = _by(median_rows(results))
    sets = sorted({ts for ts, _ in by})
    out: dict[str, Any] = {"targets": GOALS}
    rates = {f"{ts}/{p}": by[ts, p]["deadline_rate"] for ts in sets for p in DEADLINE_POLICIES if (ts, p) in by}
    out["deadline_rates"] = rates
    out["deadline_rate_met"] = all(r >= GOALS["deadline_rate"] for r in rates.values())
    for ts in sets:
        if (ts, "portfolio") not in by:
            continue
        p = by[ts, "portfolio"]
        out[f"{ts}/portfolio_vs_limit"] = p["vs_limit"]
        out[f"{ts}/portfolio_vs_limit_met"] = p["vs_limit"] <= GOALS["portfolio_vs_limit"]
        if (ts, "uniform-progress") in by:
            up = by[ts, "uniform-progress"]
            ratio = p["median_cost_per_work"] / up["median_cost_per_work"]
            out[f"{ts}/portfolio_vs_uniform_progress"] = ratio
            met = ratio <= GOALS["portfolio_vs_uniform_progress"] and p["deadline_rate"] >= up["deadline_rate"]
            out[f"{ts}/portfolio_vs_uniform_progress_met"] = met
        static = [r["median_cost_per_work"] for (s, pol), r in by.items() if s == ts and pol.startswith("portfolio[")]
        if static and (ts, "portfolio-moves") in by:
            ratio = min(static) / by[ts, "portfolio-moves"]["median_cost_per_work"]
            out[f"{ts}/moves_vs_best_static"] = ratio
            out[f"{ts}/moves_vs_best_static_met"] = ratio >= GOALS["moves_vs_best_static"]
    hourly = _by([r for r in median_rows(sweep) if r["billing"] == "hourly-2016"])
    for ts in sets:
        if (ts, "portfolio") in hourly and (ts, "on-demand") in hourly:
            saving = (
                1 - hourly[ts, "portfolio"]["median_cost_per_work"] / hourly[ts, "on-demand"]["median_cost_per_work"]
            )
            out[f"{ts}/hourly_2016_saving_vs_on_demand"] = saving
    if real is not None:
        out["real_mode_cost_error"], out["real_mode_finish_error"] = real["cost_error"], real["finish_error"]
        out["real_mode_within_10pct_met"] = real["within_10pct"]
    return out


def plot(report: dict[str, Any], path: str | Path) -> None:
    """Per trace set: the median start's machines held (left) and dollars spent (middle) over time per policy,
    and the cost per work of every start per policy beside the physical limit (right)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["trace_set"] for r in report["results"]))
    fig, axes = plt.subplots(len(sets), 3, figsize=(18, 3.8 * len(sets)), squeeze=False)
    for (held_ax, spent_ax, cost_ax), ts in zip(axes, sets, strict=True):
        rows = [r for r in report["results"] if r["trace_set"] == ts]
        policies = list(dict.fromkeys(r["policy"] for r in rows))
        for p in policies:
            median: dict[str, Any] = next((r for r in rows if r["policy"] == p and "held" in r), {})
            held: list[tuple[float, int, int]] = median.get("held", [])
            held_ax.step([h for h, _, _ in held], [s + o for _, s, o in held], where="post", label=p)
            spent: list[tuple[float, float]] = median.get("spent", [])
            spent_ax.plot([h for h, _ in spent], [usd for _, usd in spent], label=p)
        held_ax.set_title(f"{ts}: machines held from the median start")
        held_ax.set_ylabel("machines (spot + on-demand)")
        spent_ax.set_title(f"{ts}: dollars spent from the median start")
        spent_ax.set_ylabel("$")
        for ax in (held_ax, spent_ax):
            ax.set_xlabel("hours from the start")
            ax.legend(fontsize=7)
        cost_ax.boxplot(
            [[r["cost_per_work"] for r in rows if r["policy"] == p] for p in policies], tick_labels=policies
        )
        cost_ax.axhline(rows[0]["limit_cost_per_work"], color="grey", linestyle="--", label="physical limit")
        cost_ax.set_title("every start")
        cost_ax.set_ylabel("$ per V100-hour of work")
        cost_ax.tick_params(axis="x", rotation=30, labelsize=7)
        cost_ax.legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
