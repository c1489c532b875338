"""Shared test fixtures: where the published PipeDream profiles are, if this checkout has them."""

from pathlib import Path

import pytest

PROFILES = Path(__file__).resolve().parents[2] / "shared" / "pipedream-profiles"


@pytest.fixture
def pipedream_profiles() -> Path:
    """The folder of PipeDream's published graph.txt profiles (``../shared`` beside the checkout)."""
    if not PROFILES.is_dir():
        pytest.skip(f"PipeDream profiles not found at {PROFILES} (only CI and developer machines have ../shared)")
    return PROFILES
