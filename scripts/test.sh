#!/usr/bin/env bash
# The project's test command: the documentation site built with warnings as errors (mkdocs.yml, into site/),
# then every test tier (fast, slow, root, gpu: markers in pyproject.toml; a tier a machine cannot run is skipped,
# saying why), in parallel, then the `serial` tests alone. CI (.ci/run) runs this file in a fresh virtual environment and the README quotes its last line,
# which a test keeps the same.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install torch==2.13.0 && pip install -e ".[test,docs]" && ruff check src tests && ruff format --check src tests && mypy && mkdocs build --strict --site-dir site && pytest -q -m "not serial" --durations=15 && pytest -q -m serial --durations=5
