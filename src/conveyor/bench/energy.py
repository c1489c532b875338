"""``conveyor bench energy``: Zeus' published traces replayed under the default configuration, Conveyor's
batch-size search with just-in-time power limits, the oracle's best fixed configuration and, where it imports,
Zeus' own trace-driven simulator (Zeus, NSDI'23, §6)."""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.progress import Progress

from conveyor.energy import Workload, WorkloadTrace, load_traces, replay, search_policy, zeus_cost

__all__ = ["PAPER", "WORKLOADS", "EnergyBenchConfig", "default_traces", "plot", "report", "run", "run_workload"]

# The six workloads as Zeus' artifact defines them (examples/research_reproducibility/zeus_nsdi23/run_alibaba.py,
# get_job_with_defaults): target metric, epoch budget and default batch size b0 (capped per GPU by the largest
# batch size its power trace has).
WORKLOADS = (
    Workload("cifar100", "shufflenetv2", "adadelta", 0.6, 100, 1024),
    Workload("imagenet", "resnet50", "adadelta", 0.65, 100, 256),
    Workload("librispeech", "deepspeech2", "adamw", 40.0, 16, 256),
    Workload("movielens-1m", "ncf", "adam", 0.41, 100, 1024),
    Workload("squad", "bert_base_uncased", "adamw", 84.0, 6, 32),
    Workload("sentiment140", "bert_base_uncased", "adamw", 0.84, 10, 128),
)
# The paper's abstract: Zeus improves energy efficiency by 15.3%-75.8% across its workloads.
PAPER = {"energy_reduction_range": (0.153, 0.758)}


def default_traces() -> Path:
    """``../shared/zeus-traces`` beside the project."""
    return Path(__file__).resolve().parents[4] / "shared" / "zeus-traces"


@dataclass(frozen=True)
class EnergyBenchConfig:
    """The reproduction: every workload on every GPU, ``recurrences`` recurrences, averaged over ``seeds``."""

    traces: str
    gpus: tuple[str, ...] = ("v100", "a40", "rtx6000", "p100")
    recurrences: int = 50
    seeds: tuple[int, ...] = (1, 2, 3, 4, 5)
    eta: float = 0.5
    beta: float = 2.0


def _with_b0(trace: WorkloadTrace) -> WorkloadTrace:
    """Cap the default batch size at the largest one the GPU's power trace has (as Zeus' artifact does)."""
    b0 = min(trace.workload.default_batch_size, max(trace.power))
    return WorkloadTrace(replace(trace.workload, default_batch_size=b0), trace.gpu, trace.target_epochs, trace.power)


def _zeus(trace: WorkloadTrace, cfg: EnergyBenchConfig, seed: int) -> dict[str, float] | None:
    """Zeus' own simulator (``zeus._legacy.simulate``) on the same traces; None where it does not import."""
    try:
        import pandas as pd
        from zeus._legacy.job import Job
        from zeus._legacy.policy.optimizer import JITPowerLimitOptimizer, PruningGTSBatchSizeOptimizer
        from zeus._legacy.simulate import Simulator
    except ImportError:
        return None
    folder, w = Path(cfg.traces), trace.workload
    power = pd.read_csv(folder / f"summary_power_{trace.gpu}.csv")
    power = power[(power.dataset == w.dataset) & (power.optimizer == w.optimizer)]  # its merge keeps one optimizer
    sim = Simulator(
        pd.read_csv(folder / "summary_train.csv"),
        power,
        PruningGTSBatchSizeOptimizer(seed=seed, verbose=False),
        JITPowerLimitOptimizer(verbose=False),
        seed=seed,
        verbose=False,
    )
    job = Job(w.dataset, w.network, w.optimizer, w.target, w.max_epochs, w.default_batch_size)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints as it goes, whatever verbose says
        history = sim.simulate_one_job(job, cfg.recurrences, cfg.beta, cfg.eta)
    energy, time_s = sum(h.energy for h in history), sum(h.time for h in history)
    return {"energy_j": energy, "time_s": time_s, "cost": zeus_cost(energy, time_s, cfg.eta, trace.max_power)}


def run_workload(trace: WorkloadTrace, cfg: EnergyBenchConfig) -> list[dict[str, Any]]:
    """Every policy on one workload and GPU, means over the seeds; regret = cost - the oracle's."""
    trace = _with_b0(trace)
    w, top = trace.workload, int(trace.max_power)
    totals: dict[str, list[dict[str, float]]] = {"default": [], "conveyor": [], "oracle": [], "zeus": []}
    for seed in cfg.seeds:
        default = replay(
            trace,
            _always(w.default_batch_size),
            recurrences=cfg.recurrences,
            eta=cfg.eta,
            beta=None,
            seed=seed,
            limit=_always(top),
        )
        ours = replay(
            trace,
            search_policy(trace, cfg.beta, seed),
            recurrences=cfg.recurrences,
            eta=cfg.eta,
            beta=cfg.beta,
            seed=seed,
        )
        fixed = [
            replay(trace, _always(b), recurrences=cfg.recurrences, eta=cfg.eta, beta=None, seed=seed, limit=_always(p))
            for b in trace.batch_sizes
            if _always_reaches(trace, b)
            for p in trace.power[b]
        ]
        oracle = min(fixed, key=lambda o: o.cost)
        for name, out in (("default", default), ("conveyor", ours), ("oracle", oracle)):
            totals[name].append({"energy_j": out.energy_j, "time_s": out.time_s, "cost": out.cost})
        if (theirs := _zeus(trace, cfg, seed)) is not None:
            totals["zeus"].append(theirs)
    oracle_cost = float(np.mean([t["cost"] for t in totals["oracle"]]))
    rows = []
    for policy, runs in totals.items():
        if runs:
            mean = {k: float(np.mean([r[k] for r in runs])) for k in ("energy_j", "time_s", "cost")}
            rows.append(
                {
                    "workload": w.name,
                    "gpu": trace.gpu,
                    "policy": policy,
                    **mean,
                    "regret": mean["cost"] - oracle_cost,
                    "default_batch_size": w.default_batch_size,
                }
            )
    return rows


def _always(value: int) -> Callable[[Any], int]:
    """A policy (or power limit) that answers ``value`` whatever it is asked."""
    return lambda _: value


def _always_reaches(trace: WorkloadTrace, size: int) -> bool:
    """Whether every seed's path of ``size`` reaches the target within the epoch budget (a fixed configuration
    that sometimes fails would be retried forever by an oracle that cannot change it)."""
    epochs = trace.target_epochs[size]
    return all(not math.isnan(e) and e <= trace.workload.max_epochs for e in epochs)


def run(cfg: EnergyBenchConfig) -> list[dict[str, Any]]:
    """Every workload on every GPU, with a progress bar."""
    rows: list[dict[str, Any]] = []
    with Progress() as bar:
        task = bar.add_task("replaying", total=len(cfg.gpus) * len(WORKLOADS))
        for gpu in cfg.gpus:
            for trace in load_traces(Path(cfg.traces), list(WORKLOADS), gpu):
                rows += run_workload(trace, cfg)
                bar.advance(task)
    return rows


def report(cfg: EnergyBenchConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON report: rows, energy reductions against the default, goals judged per workload and GPU."""
    by = {(r["workload"], r["gpu"], r["policy"]): r for r in rows}
    low, high = PAPER["energy_reduction_range"]
    checks = []
    for workload, gpu in dict.fromkeys((r["workload"], r["gpu"]) for r in rows):
        default, ours = by[(workload, gpu, "default")], by[(workload, gpu, "conveyor")]
        theirs = by.get((workload, gpu, "zeus"))
        reduction = 1 - ours["energy_j"] / default["energy_j"]
        check: dict[str, Any] = {
            "workload": workload,
            "gpu": gpu,
            "energy_reduction": reduction,
            "within_paper_range": low <= reduction <= high,
        }
        if theirs is not None:
            check["zeus_energy_reduction"] = 1 - theirs["energy_j"] / default["energy_j"]
            check["cost_vs_zeus"] = ours["cost"] / theirs["cost"] - 1
            check["cost_within_10pct_of_zeus"] = abs(check["cost_vs_zeus"]) <= 0.10
        checks.append(check)
    goals = {
        "energy_reduction_in_paper_range_everywhere": all(c["within_paper_range"] for c in checks),
        "cost_within_10pct_of_zeus_everywhere": all(c.get("cost_within_10pct_of_zeus", False) for c in checks),
    }
    return {"config": asdict(cfg), "results": rows, "checks": checks, "paper": PAPER, "goals": goals}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Energy to accuracy over the recurrences, relative to the default configuration, per workload and GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gpus = list(dict.fromkeys(r["gpu"] for r in rows))
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = [p for p in ("conveyor", "zeus", "oracle") if any(r["policy"] == p for r in rows)]
    by = {(r["workload"], r["gpu"], r["policy"]): r for r in rows}
    fig, axes = plt.subplots(1, len(gpus), figsize=(3.2 * len(gpus), 3.6), sharey=True, squeeze=False)
    for ax, gpu in zip(axes[0], gpus, strict=True):
        x = np.arange(len(workloads))
        for i, policy in enumerate(policies):
            share = [by[(w, gpu, policy)]["energy_j"] / by[(w, gpu, "default")]["energy_j"] for w in workloads]
            ax.bar(x + (i - (len(policies) - 1) / 2) * 0.27, share, 0.27, label=policy)
        ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
        ax.set_xticks(x, [w.split("/")[0] for w in workloads], rotation=60, fontsize=7)
        ax.set_title(gpu)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("energy to accuracy / default's")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="upper center", ncol=len(policies), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
