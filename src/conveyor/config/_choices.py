"""The values the commands' options accept (``conveyor train``'s, and the spot policies of ``conveyor
markets``), and the checks of those written as text: torch-free and SciPy-free, so the command line, its parser
and its config file import neither, and the systems that act on them read them here."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any, Literal, NamedTuple

from conveyor.errors import InputError

__all__ = [
    "AUTOCAST",
    "BACKENDS",
    "DEFAULT_MODE",
    "DEVICES",
    "MARKET_POLICIES",
    "MATERIALIZE",
    "METER_RANK",
    "MODES",
    "OPTIMIZERS",
    "STALE_RATES",
    "WAN_ESTIMATES",
    "WAN_MODES",
    "Chunks",
    "ModeSettings",
    "check_chunks",
    "check_meter_spec",
    "check_resources_every",
    "mode_settings",
    "model_arguments",
    "parse_power_limit",
    "split_meter_spec",
]

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "nccl", "gloo")
AUTOCAST = ("off", "bf16")  # bf16: torch.bfloat16 (conveyor.job looks the dtype up where it is used)
OPTIMIZERS = ("sgd", "adam")  # torch.optim.SGD and Adam (looked up in conveyor.job)
STALE_RATES = ("auto", "sample", "damped")  # the stale-gradient correction's rate (conveyor.plan.parts.EpochFactors)
MATERIALIZE = ("whole", "stage")


def model_for_dataset(dataset: str | None) -> str:
    """The zoo model ``--model auto`` trains on ``dataset`` (read from its name: nothing is loaded): ``gpt`` for
    text, ``resnet`` for images, ``mlp`` for feature vectors (the digits, a one-dimensional synthetic shape, and
    ``hf:`` folders, whose inputs are known only once read).

    Example:
        >>> [model_for_dataset(d) for d in (None, "text:notes.txt", "imagefolder:~/pics", "synthetic:3x8x8:4:256")]
        ['mlp', 'gpt', 'resnet', 'resnet']
    """
    spec = dataset or "digits"
    if spec in ("text", "synthetic-text") or spec.startswith("text:"):
        return "gpt"
    images = spec in ("digit-images", "synthetic-images") or spec.startswith(("imagefolder:", "torchvision:"))
    if images or (spec.startswith("synthetic:") and spec.split(":")[1].count("x") == 2):
        return "resnet"
    return "mlp"


MARKET_POLICIES = ("on-demand", "spot-restart", "bidbrain", "uniform-progress", "portfolio", "portfolio-moves")
WAN_MODES = ("off", "gaia", "diloco")
WAN_ESTIMATES = ("auto", "on", "off")  # gaia's estimate; auto: a pilot decides (conveyor.gaia.pilot_estimate)
# FlexRR is slack and reassignment (Harlap et al., SoCC 2016); backup is reassignment and backups, synchronous;
# live is reassignment and backups reduced among the replicas whose runs were used (no all-reduce), synchronous.
MODES = ("live", "flexrr", "slack", "reassign", "backup", "off")
DEFAULT_MODE = "off"
METER_RANK = "{rank}"  # in a replay PATH of --energy-meter: each worker reads its own log
_METERS = "auto, off or replay:PATH"

Chunks = int | Literal["auto"]  # chunks each replica owns, or auto


class ModeSettings(NamedTuple):
    """What a straggler mode turns on."""

    slack: int
    reassign: bool
    backup: bool
    live: bool = False


def mode_settings(mode: str, slack: int) -> ModeSettings:
    """The settings of ``mode``, with slack ``slack`` where it applies.

    Example:
        >>> [tuple(mode_settings(m, 2)) for m in MODES]  # doctest: +NORMALIZE_WHITESPACE
        [(0, True, True, True), (2, True, False, False), (2, False, False, False), (0, True, False, False),
         (0, True, True, False), (0, False, False, False)]
    """
    if mode not in MODES:
        raise InputError(f"unknown straggler mode {mode!r}: use one of {', '.join(MODES)}")
    if slack < 1 and mode in ("flexrr", "slack"):
        raise InputError(f"--stragglers {mode} needs --slack of at least 1, got {slack}")
    return ModeSettings(
        slack=slack if mode in ("flexrr", "slack") else 0,
        reassign=mode in ("live", "flexrr", "reassign", "backup"),
        backup=mode in ("live", "backup"),
        live=mode == "live",
    )


def check_chunks(chunks: object) -> Chunks:
    """``chunks`` if it is a count of at least 1 or ``"auto"``; else a one-line error.

    Example:
        >>> check_chunks("auto"), check_chunks(3)
        ('auto', 3)
        >>> check_chunks(True)
        Traceback (most recent call last):
        conveyor.errors.InputError: --chunks must be at least 1 or auto, got True
    """
    if chunks == "auto" or (isinstance(chunks, int) and not isinstance(chunks, bool) and chunks >= 1):
        return chunks
    raise InputError(f"--chunks must be at least 1 or auto, got {chunks!r}")


def model_arguments(text: str) -> dict[str, Any]:
    """``--model-args``: ``"num_classes=10,depths=[1,1],name=x"`` -> ``{"num_classes": 10, "depths": [1, 1],
    "name": "x"}``: items split at the commas outside brackets and quotes, each value a Python literal or else a
    bare word (a string).

    Raises:
        InputError: an empty item, an item that is not ``NAME=VALUE``, a name given twice, an unbalanced bracket
            or quote, or a value with brackets, quotes or commas that is no Python literal (one line naming it).

    Example:
        >>> model_arguments("n=2,,d=6")
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: --model-args 'n=2,,d=6': item 2 is empty (two commas in a row, or one at an end)
    """
    out: dict[str, Any] = {}
    if not text.strip():
        return out
    for n, item in enumerate(_items(text), 1):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not item:
            raise InputError(f"--model-args {text!r}: item {n} is empty (two commas in a row, or one at an end)")
        if not equals or not name.isidentifier() or not value:
            raise InputError(
                f"--model-args {text!r}: item {item!r} is not NAME=VALUE: give NAME=VALUE items, e.g. num_classes=10"
            )
        if name in out:
            raise InputError(f"--model-args {text!r}: {name} is given twice")
        try:
            out[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            if re.search(r"[\[\](){}'\",=]", value):
                raise InputError(
                    f"--model-args {text!r}: {name}={value} is no Python value (a list [1, 2], a string 'x' or x)"
                ) from None
            out[name] = value
    return out


def _items(text: str) -> list[str]:
    """``text`` split at its commas outside brackets and quotes, each item stripped.

    Raises:
        InputError: a bracket closes none, or a bracket or quote is left open.
    """
    items, depth, quote, start = [], 0, "", 0
    for i, c in enumerate(text):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{" or c in ")]}":
            depth += 1 if c in "([{" else -1
            if depth < 0:
                raise InputError(f"--model-args {text!r}: the {c!r} at character {i + 1} closes no bracket")
        elif c == "," and depth == 0:
            items.append(text[start:i].strip())
            start = i + 1
    if depth or quote:
        raise InputError(f"--model-args {text!r}: a {'quote' if quote else 'bracket'} is left open")
    return [*items, text[start:].strip()]


def split_meter_spec(spec: str) -> tuple[str, str | None]:
    """``(kind, path)`` of an ``--energy-meter`` value; one line for anything but auto, off or replay:PATH."""
    if spec in ("auto", "off"):
        return spec, None
    if spec.startswith("replay:") and spec.removeprefix("replay:").strip():
        return "replay", spec.removeprefix("replay:")
    raise InputError(
        f"--energy-meter {spec!r}: use {_METERS} (a Zeus CSV log; {METER_RANK} in PATH: one log per worker)"
    )


def check_meter_spec(spec: str) -> None:
    """Check an ``--energy-meter`` value: ``auto``, ``off`` or ``replay:PATH``.

    A replay PATH without ``{rank}`` is read by every worker, so it must exist; with ``{rank}`` each worker reads
    its own file, and a worker whose file is missing simply has no meter.

    Example:
        >>> check_meter_spec("auto")
        >>> check_meter_spec("joules")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: --energy-meter 'joules': use auto, off or replay:PATH (...)
    """
    kind, path = split_meter_spec(spec)
    if kind == "replay" and path is not None and METER_RANK not in path and not os.path.isfile(path):
        raise InputError(f"--energy-meter {spec}: no replay log at {path}")


def parse_power_limit(spec: str | int) -> str | int:
    """``"auto"``, ``"max"`` or a positive number of watts, from a ``--power-limit`` value.

    Example:
        >>> [parse_power_limit(spec) for spec in ("auto", "max", "250")]
        ['auto', 'max', 250]
        >>> parse_power_limit("250W")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        conveyor.errors.InputError: --power-limit must be 'auto', 'max' or a whole number of watts ..., got '250W'
    """
    text = str(spec).strip().lower()
    if isinstance(spec, str) and text in ("auto", "max"):
        return text
    if not isinstance(spec, bool) and text.isascii() and text.isdecimal() and int(text) > 0:
        return int(text)
    raise InputError(f"--power-limit must be 'auto', 'max' or a whole number of watts such as 250, got {spec!r}")


def check_resources_every(seconds: float | None) -> None:
    """One line for a bad ``--resources-every`` before any worker starts."""
    if seconds is None:
        return
    if not seconds > 0:
        raise InputError(f"--resources-every is a period in seconds above 0, got {seconds}")
    if not Path("/proc/self/status").exists():
        raise InputError("--resources-every reads /proc/self, which only Linux has: drop it on this system")
