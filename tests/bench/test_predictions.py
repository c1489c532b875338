"""conveyor bench predictions: each run's prediction set against its measurement."""

import pytest

from conveyor.bench.predictions import PredictionsConfig, run
from conveyor.errors import InputError

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_report_sets_each_prediction_against_its_measurement() -> None:
    report = run(
        PredictionsConfig(models=("mlp",), workers=2, epochs=1, seconds=0.0, repeats=1, schedules=("auto", "dp"))
    )
    planned, data_parallel = report["results"]
    assert planned["epochs"] == data_parallel["epochs"] == 1  # no seconds asked for beyond the least epochs
    for result in (planned, data_parallel):
        assert result["model"] == "mlp" and sum(result["replicas"]) == 2 == result["workers_started"]
        assert result["predicted_samples_per_s"] > 0 and result["measured_samples_per_s"] > 0
        error = result["measured_samples_per_s"] / result["predicted_samples_per_s"] - 1
        assert result["error"] == pytest.approx(error)
    assert data_parallel["asked"] == "dp" and data_parallel["replicas"] == [2]
    assert report["median_error"] == {"mlp auto": planned["error"], "mlp dp": data_parallel["error"]}
    assert report["same_layout"] == {"mlp auto": True, "mlp dp": True}  # one run each: trivially the same
    assert report["goal"]["met"] == (max(abs(planned["error"]), abs(data_parallel["error"])) <= 0.15)
    assert {c["workers"] for c in planned["candidates"]} == {2}  # a given count: all of it is planned


@pytest.mark.slow
def test_a_users_own_model_is_predicted_on_the_dataset_asked() -> None:
    """The held-out path: a module of the user's (examples/models.py, from the repository's root), split by
    torch.export; its images come from --dataset (on the default digits' flat rows it could not run)."""
    report = run(
        PredictionsConfig(models=("examples.models:TinyCNN",), dataset="digit-images", epochs=2, seconds=0, repeats=1)
    )
    (result,) = report["results"]
    assert result["model"] == "examples.models:TinyCNN" and report["config"]["dataset"] == "digit-images"
    assert result["predicted_samples_per_s"] > 0 and result["measured_samples_per_s"] > 0


def test_an_unknown_model_or_dataset_fails_before_any_run() -> None:
    with pytest.raises(InputError, match=r"^unknown dataset 'nope': use one of digits"):
        run(PredictionsConfig(models=("mlp",), dataset="nope"))
    with pytest.raises(InputError, match="nope"):
        run(PredictionsConfig(models=("mlp", "nope")))  # the second model, before the first trains


def test_bad_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        PredictionsConfig(repeats=0)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag': use auto, dp or one of"):
        PredictionsConfig(schedules=("zigzag",))
    with pytest.raises(ValueError, match="seconds is 0 or more, got -1"):
        PredictionsConfig(seconds=-1)
