"""A mkdocs hook: the command-line reference (reference/cli.md) rendered from the ``conveyor`` command's own parser.

The page holds a marker line, ``<!-- cli-reference -->``; at build time it is replaced by every command and
subcommand of ``conveyor.cli``'s parser: its usage, description, and each option's flags, default and help, as
``conveyor COMMAND --help`` prints them. The parser is imported from this checkout's ``src`` (it needs numpy and
rich, not torch), so the page always matches the code being built.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

MARKER = "<!-- cli-reference -->"
PAGE = "reference/cli.md"
WIDTH = 100  # usage lines are wrapped at this many characters
SRC = Path(__file__).resolve().parents[2] / "src"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} lost its marker line {MARKER!r}: the hook has nowhere to put the reference")
    return markdown.replace(MARKER, render(_parser()))


def _parser() -> argparse.ArgumentParser:
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from conveyor.cli import _parser

    return _parser()


def render(parser: argparse.ArgumentParser) -> str:
    """Every command of ``parser`` as Markdown, the top level first, then each subcommand depth first."""
    out: list[str] = []
    _render(parser, parser.prog, None, 2, out)
    return "\n".join(out)


def _render(parser: argparse.ArgumentParser, name: str, summary: str | None, level: int, out: list[str]) -> None:
    out += [f"{'#' * level} `{name}`", ""]
    if parser.description or summary:
        out += [_text(parser.description or summary or ""), ""]
    usage = parser.formatter_class(prog=parser.prog, width=WIDTH)  # not the terminal's: the same page everywhere
    usage.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    out += ["```text", usage.format_help().strip(), "```", ""]
    subcommands: list[tuple[str, argparse.ArgumentParser, str | None]] = []
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction):
                helps = {choice.dest: choice.help for choice in action._choices_actions}
                rows += [_subcommand_row(sub, helps.get(sub)) for sub in action.choices]
                subcommands += [(sub, p, helps.get(sub)) for sub, p in action.choices.items()]
            elif action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                rows.append(_option_row(parser, action))
        if rows:
            title = {"options": "Options", "positional arguments": "Arguments"}.get(group.title or "", group.title)
            out += [f"**{_text(title or '')}**", "", "| | default | what it does |", "| --- | --- | --- |", *rows, ""]
    for sub_name, sub, help_text in subcommands:
        _render(sub, f"{name} {sub_name}", help_text, min(level + 1, 6), out)


def _subcommand_row(name: str, help_text: str | None) -> str:
    return f"| `{name}` | | {_cell(help_text or '')} |"


def _option_row(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = argparse.HelpFormatter(parser.prog)
    if not action.option_strings:  # a positional argument: its name as usage shows it
        flags = f"`{formatter._format_args(action, action.dest)}`"
    elif action.nargs == 0:
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings)
    else:
        metavar = formatter._format_args(action, action.dest.upper())
        flags = ", ".join(f"`{flag} {metavar}`" for flag in action.option_strings)
    help_text = formatter._expand_help(action) if action.help else ""
    return f"| {flags} | {_default(action)} | {_cell(help_text)} |"


def _default(action: argparse.Action) -> str:
    """An option's default as the command takes it; none for a positional argument or a plain flag (off unless
    given), on or off for a ``--x/--no-x`` pair."""
    default = getattr(action, "config_default", action.default)  # conveyor.config.CONFIG_DEFAULT: its field's
    if not action.option_strings or default in (None, argparse.SUPPRESS):
        return ""
    if isinstance(action, argparse.BooleanOptionalAction):
        return "on" if action.default else "off"
    if action.nargs == 0:
        return ""
    return _cell(f"`{default}`") if not isinstance(default, str) or default else '`""`'


def _text(text: str) -> str:
    """Prose from the parser as Markdown text: characters Markdown would read as markup are escaped."""
    for char in "\\`*_[]<>":
        text = text.replace(char, "\\" + char)
    return " ".join(text.split())


def _cell(text: str) -> str:
    """Text for a table cell: as :func:`_text`, and no pipe that would end the cell (code spans kept as they are)."""
    if text.startswith("`") and text.endswith("`"):
        return text.replace("|", "\\|")
    return _text(text).replace("|", "\\|")
