"""conveyor bench models: a user's module split against itself unsplit, beside its zoo twin, planned, in two
stages."""

import json

import pytest

from conveyor.bench.models import Case, ModelsBenchConfig, run

pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow
def test_report_sets_the_split_beside_the_unsplit_model_and_its_twin() -> None:
    cases = {"module-mlp": Case("conveyor.bench.models:TwinMLP", epochs=2, twin="mlp")}
    memory = Case("conveyor.bench.models:TwinMLP", "width=512,depth=3", epochs=2)
    report = run(ModelsBenchConfig(models=("module-mlp",), workers=2, cases=cases, memory=memory))
    (result,) = report["results"]
    assert result["case"] == "module-mlp" and result["dataset"] == "digits"
    unsplit, split = result["plain_unsplit_samples_per_s"], result["plain_split_samples_per_s"]
    assert unsplit > 0 and split > 0 and result["split_over_unsplit"] == pytest.approx(split / unsplit)
    # The same weights on the same batches: the split trains as the model does.
    assert result["plain_split_accuracy"] == pytest.approx(result["plain_accuracy"], abs=1e-6)
    assert len(result["plain_accuracy"]) == 2 and len(result["two_stages"]["accuracy"]) == 2
    assert len(result["two_stages"]["layout"]["balance"]) == 2
    planned = result["planned"]
    assert sum(planned["layout"]["replicas"]) == 2 and len(planned["peak_rss_bytes"]) == 2
    assert result["twin"]["model"] == "mlp" and result["twin"]["samples_per_s"] > 0
    assert result["conveyor_one_worker"]["layout"]["replicas"] == [1]
    built = report["memory"]
    assert built["weight_bytes"] == 4 * (64 * 512 + 2 * 512 * 512 + 512 * 10 + 3 * 512 + 10)
    for how in ("whole", "stage"):  # both train, in two stages, and say each worker's peak memory
        assert len(built[how]["layout"]["balance"]) == 2 and len(built[how]["peak_rss_bytes"]) == 2
        assert built[how]["accuracy"][-1] > 0.5, built[how]["accuracy"]
    json.dumps(report)


def test_bad_config_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"unknown models \['bert'\]"):
        ModelsBenchConfig(models=("bert",))
    with pytest.raises(ValueError, match="--workers must be at least 2"):
        ModelsBenchConfig(workers=1)
