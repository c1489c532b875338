"""The ``conveyor`` command: ``train``, ``profile``, ``plan``, ``emulate ...``, ``cluster ...``, ``models ...``,
``markets ...`` and ``bench ...``, one module per group."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from conveyor.cli import _bench, _cluster, _emulate, _markets, _models, _plan, _train
from conveyor.cli._common import Parser
from conveyor.errors import InputError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="conveyor", description="Pipeline-parallel PyTorch training.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _train.add_parser(sub)
    _plan.add_parsers(sub)
    _emulate.add_parser(sub)
    _cluster.add_parser(sub)
    _models.add_parser(sub)
    _markets.add_parser(sub)
    _bench.add_parser(sub)
    return parser


def _version() -> str:
    try:
        return version("conveyor")
    except PackageNotFoundError:  # run from a source tree that pip has not installed
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``conveyor`` command; returns the exit status."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to say how to go on after an interrupt
    commands: dict[str, Callable[[argparse.Namespace], int | None]] = {
        "train": _train.run,
        "profile": _plan.profile,
        "plan": _plan.plan,
        "emulate": _emulate.run,
        "cluster": _cluster.run,
        "models": _models.run,
        "markets": _markets.run,
        "bench": _bench.run,
    }
    try:
        return commands[args.command](args) or 0
    except KeyboardInterrupt:  # a second Ctrl-C, or one where nothing was running to save
        print("conveyor: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        status = _report(exc)
        if status is None:
            raise
        return status


def _report(exc: Exception) -> int | None:
    """Print an error the user can fix in one line and return the exit status; ``None`` for a bug (whose traceback
    Python then prints). Bad input is an :class:`~conveyor.errors.InputError` (or an ``OSError``: a file, a
    permission, a privilege); any other exception, a ``ValueError`` from PyTorch included, is a bug."""
    # Only a command that ran the runtime (and so imported torch) can raise its errors; planning does not.
    runtime = sys.modules.get("conveyor.runtime")
    if runtime is not None and isinstance(exc, runtime.WorkerError):
        if os.environ.get("CONVEYOR_TRACEBACK") or not exc.bad_input:
            print(exc.remote_traceback, file=sys.stderr)  # a worker's bug: where it happened
        print(f"conveyor: error: worker {exc.rank}: {exc.error_type}: {exc.message}", file=sys.stderr)
        return 1
    if isinstance(exc, InputError | OSError) or (runtime is not None and isinstance(exc, runtime.WorldSizeError)):
        lines = str(exc).splitlines() or [type(exc).__name__]
        print(f"conveyor: error: {lines[0]}", file=sys.stderr)  # one line; the rest is for CONVEYOR_TRACEBACK
        if os.environ.get("CONVEYOR_TRACEBACK"):
            print("\n".join(lines[1:]), file=sys.stderr)
        return 2
    return None
