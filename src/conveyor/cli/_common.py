"""What the ``conveyor`` commands share: argument types, filling configs from options, writing reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from rich.console import Console

from conveyor.config import CONFIG_DEFAULT, EmulationConfig, add_options, positive, positive_or_auto

__all__ = [
    "Parser",
    "add_emulation",
    "config",
    "console",
    "finish_report",
    "names",
    "positive",
    "positive_or_auto",
    "sizes",
    "write_json",
]


def output_width() -> int | None:
    """The tables' width: the terminal's (``None``: rich asks it) or ``COLUMNS``; 160 for a log file or a pipe,
    which have no width of their own and where rich would fit a table into 80 columns, cutting its cells."""
    return None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160


console = Console(width=output_width())
_C = TypeVar("_C")


class _DefaultsFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default, where it has one worth saying (not None, not a flag's)
    and the text does not already say it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = getattr(action, CONFIG_DEFAULT, action.default)
        flag = action.nargs == 0  # --x / --no-x: their defaults read backwards
        if default in (None, "", argparse.SUPPRESS) or flag or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: {str(default).replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    """The ``conveyor`` command's parsers (its subcommands' too): every option's help shows its default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _DefaultsFormatter)
        super().__init__(*args, **kwargs)


def sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"write sizes as 8,16,32, not {text!r}") from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be at least 1, got {text!r}")
    return values


def floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"write numbers as 1.25e7,1.25e8, not {text!r}") from None
    if min(values) <= 0:
        raise argparse.ArgumentTypeError(f"numbers must be above 0, got {text!r}")
    return values


def names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def config(cls: type[_C], args: argparse.Namespace) -> _C:
    """A config dataclass filled from the options of the same name; fields without an option keep defaults."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]  # every config is a dataclass
    return cls(**{f.name: getattr(args, f.name) for f in fields if hasattr(args, f.name)})


def finish_report(args: argparse.Namespace, result: dict[str, Any], plot: Callable[[Any, Path], None]) -> None:
    """A benchmark's last lines: its goals, then its plot of ``result["results"]`` (``--plot``) and the report
    (``--json``) where asked."""
    console.print(f"goals: {result['goals']}")
    if args.plot:
        plot(result["results"], args.plot)
        console.print(f"wrote {args.plot}")
    if args.json:
        write_json(args.json, result)


def write_json(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))
    console.print(f"wrote {path}")


def add_emulation(parser: argparse.ArgumentParser, faults: bool = True, cpu_slice: bool = False) -> None:
    """The options that run a command's workers on an emulated cluster (conveyor.emulate), from its config
    section."""
    group = parser.add_argument_group(EmulationConfig.TITLE)
    names = ("network", "devices", *(("cpu_slice",) if cpu_slice else ()), *(("faults",) if faults else ()))
    add_options(group, EmulationConfig, only=names, absent=False)
