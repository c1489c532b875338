"""``conveyor bench warmstart``: its options and its table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import config, console, names, write_json

__all__ = ["add_warmstart", "run_warmstart"]


def add_warmstart(which: Any) -> None:
    """The ``warmstart`` benchmark's parser under ``conveyor bench``."""
    warm = which.add_parser("warmstart", help="ModelKeeper: new model variants to a target, from scratch and warm")
    warm.add_argument("--families", type=names, default=None, help="e.g. mlp,gpt (default: mlp,vgg,resnet,gpt)")
    warm.add_argument("--seed", type=int, default=None, help="every run's initial weights and data order")
    warm.add_argument("--seeds", type=int, default=None, help="run from --seed, --seed + 1, ...: this many (default 1)")
    warm.add_argument("--keep", type=Path, default=None, help="keep the model store and the run folders here")
    warm.add_argument("--json", type=Path, default=None, help="write the report here")
    warm.add_argument("--plot", type=Path, default=None, help="accuracy against time per family (PNG)")


def run_warmstart(args: argparse.Namespace) -> None:
    """Run the benchmark, print its table and goals, write the JSON and the plot."""
    from conveyor.bench.warmstart import WarmStartBenchConfig, measure_matching, plot, report, run

    given = {k: v for k, v in vars(args).items() if v is not None}  # unset options keep the config's defaults
    cfg = config(WarmStartBenchConfig, argparse.Namespace(**given))
    result = report(cfg, run(cfg, args.keep), measure_matching())
    table = Table(
        "model",
        "parent",
        "coverage",
        "seconds",
        "epochs",
        "speedup",
        "final accuracy",
        title="to the target: from scratch / warm-started" + (f" (seed {cfg.seed})" if cfg.seeds > 1 else ""),
    )
    by = {(r["family"], r["model"], r["warm_start"]): r for r in result["results"] if r["seed"] == cfg.seed}

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    for child in result["children"]:
        scratch, warm = (by[(child["family"], child["model"], w)] for w in (False, True))
        first = child.get("per_seed", [child])[0]
        bound = ">" if first["speedup_is_lower_bound"] else ""
        table.add_row(
            child["model"],
            warm["parent_model"] or "-",
            f"{first['coverage']:.0%}",
            f"{num(scratch['seconds_to_target'], '.1f')} / {num(warm['seconds_to_target'], '.1f')}",
            f"{num(scratch['epochs_to_target'], 'd')} / {num(warm['epochs_to_target'], 'd')}",
            bound + num(first["speedup"], ".2f"),
            f"{scratch['final_accuracy']:.3f} / {warm['final_accuracy']:.3f}",
        )
    console.print(table)
    for child in result["children"]:
        if "per_seed" in child:
            seeds = child["per_seed"]
            console.print(
                f"{child['model']} over {len(seeds)} seeds: speedup median {child['speedup']:.2f}x "
                f"({', '.join(num(s['speedup'], '.2f') for s in seeds)}), accuracy change median "
                f"{child['accuracy_change']:+.3f} ({', '.join(format(s['accuracy_change'], '+.3f') for s in seeds)})"
            )
    for family, figures in result["families"].items():
        console.print(
            f"{family}: median speedup {figures['median_speedup']:.2f}x, "
            f"worst accuracy change {figures['worst_accuracy_change']:+.3f} "
            f"(last 3 epochs' mean {figures['worst_last3_accuracy_change']:+.3f})"
        )
    console.print(f"matching 1 model against 1000 stored: {result['match_1000_s'] * 1000:.1f} ms")
    console.print(f"goals: {result['goals']}")
    if args.plot:
        plot(result["results"], {f: cfg.specs[f].target for f in cfg.families}, args.plot)
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, result)
