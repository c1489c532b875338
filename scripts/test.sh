#!/usr/bin/env bash
# The project's test command, every tier (fast, slow, root, gpu: markers in pyproject.toml; a tier a machine
# cannot run is skipped, saying why). CI (.ci/run) runs this file in a fresh virtual environment and the README
# quotes its last line, which a test keeps the same.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install torch==2.13.0 && pip install -e ".[test]" && ruff check src tests && ruff format --check src tests && mypy && pytest -q -m "not slow or slow"
