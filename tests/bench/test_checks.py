"""The benchmarks' shared configuration checks."""

import pytest

from conveyor.bench._checks import require_known


def test_known_names_pass_and_unknown_ones_are_listed_with_the_choices() -> None:
    require_known("modes", ["off"], ("off", "flexrr"))
    require_known("modes", [], ("off",))
    with pytest.raises(ValueError, match=r"^unknown patterns \['a', 'b'\]: choose from none, power-law$"):
        require_known("patterns", ["b", "none", "a"], {"none": 0, "power-law": 1})
