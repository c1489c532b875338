#!/usr/bin/env bash
# The project's test command: lint, types and the documentation site built with warnings as errors (mkdocs.yml,
# into site/), then every test tier (markers in pyproject.toml; a tier a machine cannot run is skipped, saying
# why): the fast tier, then the slow, root and gpu tiers, both in parallel (pytest-xdist, one process per core;
# the emulated cluster's tests share one process), then the serial tests alone (they read the machine's
# namespaces and cgroups, or time against the wall clock). CI (.ci/run) runs this file in a fresh virtual
# environment and the README quotes its last line, which a test keeps the same.
set -euo pipefail
cd "$(dirname "$0")/.."
# Bytecode is written (__pycache__, git-ignored) even where the environment says not to: otherwise every process a
# test starts compiles Conveyor's modules again (~1 s of CPU each) and every pytest process rewrites the tests'
# asserts again (~9 s of CPU each collection).
unset PYTHONDONTWRITEBYTECODE
pip install torch==2.13.0 && pip install -e ".[test,docs]" && ruff check src tests && ruff format --check src tests && mypy && mkdocs build --strict --site-dir site && pytest -q -m "not slow and not root and not gpu and not serial" --durations=5 && pytest -q -m "(slow or root or gpu) and not serial" --durations=15 && pytest -q -n 0 -m serial --durations=5
