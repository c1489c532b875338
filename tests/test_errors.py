"""The shared input checks of conveyor.errors."""

import math

import pytest

from conveyor.errors import InputError, check_amounts


def test_amounts_that_are_finite_and_not_negative_pass() -> None:
    check_amounts({"a_s": 0.0, "b_s": 2.5}, what="cost", positive=["b_s"])


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_negative_infinite_or_nan_amount_is_refused_by_name(bad: float) -> None:
    with pytest.raises(InputError, match=f"cost b_s must be a finite number >= 0, got {bad}"):
        check_amounts({"a_s": 1.0, "b_s": bad}, what="cost")


def test_a_zero_where_a_positive_amount_is_needed_is_refused_naming_each() -> None:
    with pytest.raises(InputError, match=r"^overhead a_s and c_s must be > 0$"):
        check_amounts({"a_s": 0.0, "b_s": 0.0, "c_s": 0.0}, what="overhead", positive=["a_s", "c_s"])
