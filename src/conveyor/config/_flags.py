"""A config field and its command-line option in one place: :func:`option` gives a field its default and the
option's help, choices and name; :func:`add_options` turns a section's fields into argparse options."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONFIG_DEFAULT", "Flag", "add_options", "flag_name", "option", "positive", "positive_or_auto"]


@dataclass(frozen=True, kw_only=True)
class Flag:
    """What makes a field a command-line option. ``name``: the option's name (``_`` for ``-``) where it is not
    the field's, ``""`` for a field with no option of its own (set through another, or in a config file);
    ``parse``: the argparse type (default: the field's, ``int``, ``float`` or ``str``)."""

    help: str
    name: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None


def option(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field with ``default`` whose option says ``help`` (and ``flag``'s other :class:`Flag` fields)."""
    return field(default=default, metadata={"flag": Flag(help=help, **flag)})


def flag_name(f: dataclasses.Field[Any]) -> str:
    """The option name (``_`` for ``-``) of a section's field; ``""`` where it has none."""
    flag: Flag = f.metadata["flag"]
    return f.name if flag.name is None else flag.name


def positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_or_auto(text: str) -> int | str:
    """An argparse type: a whole number of at least 1, or ``auto``."""
    if text == "auto":
        return text
    if not text.strip().isdecimal():
        raise argparse.ArgumentTypeError(f"write a whole number of at least 1, or auto, not {text!r}")
    return positive(text)


_TYPES: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def add_options(
    parser: argparse._ActionsContainer, section: type[Any], *, only: tuple[str, ...] = (), absent: bool = True
) -> None:
    """One option per field of ``section`` (those named in ``only``, where given), each with its help, choices
    and the default the help states. ``absent``: an option not given is absent from the parsed namespace (the
    section's default, or a config file's value, then holds); else it holds the field's default."""
    for f in dataclasses.fields(section):
        name = flag_name(f)
        if not name or (only and name not in only):
            continue
        flag: Flag = f.metadata["flag"]
        default = argparse.SUPPRESS if absent else f.default
        kwargs: dict[str, Any] = {"dest": name, "default": default, "help": flag.help.replace("%", "%%")}
        base = str(f.type).split(" | ")[0]
        if base == "bool":  # a switch: --name turns on what is off by default, --no-name off what is on
            kwargs.update(action="store_false" if f.default else "store_true")
            flags = f"--{'no-' if f.default else ''}{name.replace('_', '-')}"
        else:
            kwargs.update(type=flag.parse or _TYPES.get(base, str), choices=flag.choices, metavar=flag.metavar)
            flags = f"--{name.replace('_', '-')}"
        setattr(parser.add_argument(flags, **kwargs), CONFIG_DEFAULT, f.default)


CONFIG_DEFAULT = "config_default"
"""The attribute of an option made by :func:`add_options` that holds its field's default (the option's own
``default`` may be ``argparse.SUPPRESS``): the help and the command-line reference show it."""
