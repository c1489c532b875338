#!/usr/bin/env bash
# The project's test command: the documentation site built with warnings as errors (mkdocs.yml, into site/),
# then every test tier (fast, slow, root, gpu: markers in pyproject.toml; a tier a machine cannot run is skipped,
# saying why): the fast tier in parallel (one process per core), then the others one at a time (in parallel they
# ran no sooner on 2 cores: their worker processes already fill them, and rates and latencies moved). CI (.ci/run) runs this file in a fresh virtual environment and the README quotes its last line,
# which a test keeps the same.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install torch==2.13.0 && pip install -e ".[test,docs]" && ruff check src tests && ruff format --check src tests && mypy && mkdocs build --strict --site-dir site && pytest -q -m "not slow and not root and not gpu and not serial" --durations=5 && pytest -q -m "(slow or root or gpu) and not serial" --durations=15 && pytest -q -n 0 -m serial --durations=5
