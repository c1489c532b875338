"""Hypothesis strategies shared by the planner tests."""

from hypothesis import strategies as st

from conveyor.plan._profiles import Profile


def chains(max_layers: int) -> st.SearchStrategy[Profile]:
    """Random chain profiles of 1 to ``max_layers`` layers: times up to 1 s, sizes up to 1 GB."""
    return st.integers(1, max_layers).flatmap(
        lambda n: st.builds(
            Profile.chain,
            st.just("random"),
            st.lists(st.floats(1e-3, 1.0), min_size=n, max_size=n),
            st.lists(st.floats(1e-3, 1.0), min_size=n, max_size=n),
            st.lists(st.integers(0, 10**9), min_size=n, max_size=n),
            st.lists(st.integers(0, 10**9), min_size=n, max_size=n),
        )
    )
