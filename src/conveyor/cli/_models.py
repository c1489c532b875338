"""``conveyor models list|show|remove``: the model store that warm starts draw from."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.table import Table

from conveyor.cli._common import console

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    models = sub.add_parser("models", help="the stored trained models warm starts draw from")
    which = models.add_subparsers(dest="action", required=True)
    for action, text in (("list", "every stored model"), ("show", "one model, whole"), ("remove", "delete one")):
        parser = which.add_parser(action, help=text)
        if action != "list":
            parser.add_argument("id", help="the model's id (conveyor models list)")
        parser.add_argument("--store", type=Path, default=None, help="the store's folder (default: user data dir)")


def run(args: argparse.Namespace) -> None:
    from conveyor.warmstart import ModelStore

    store = ModelStore(args.store)
    if args.action == "list":
        entries = store.list()
        table = Table("id", "model", "accuracy", "parameters", "stored", title=f"{len(entries)} models in {store.root}")
        for e in entries:
            table.add_row(
                e.id,
                e.name,
                f"{e.accuracy:.3f}",
                f"{e.parameters():,}",
                time.strftime("%Y-%m-%d %H:%M", time.localtime(e.created)),
            )
        console.print(table)
    elif args.action == "show":
        entry = store.get(args.id)
        layers = [n for n in entry.graph.get("nodes", []) if n.get("params")]
        console.print(
            json.dumps(
                {
                    "id": entry.id,
                    "model": entry.name,
                    "accuracy": entry.accuracy,
                    "info": entry.info,
                    "parameters": entry.parameters(),
                    "layers": len(layers),
                    "checkpoint": str(store.checkpoint(entry.id)),
                },
                indent=2,
            )
        )
    else:
        store.remove(args.id)
        console.print(f"removed {args.id} from {store.root}")
