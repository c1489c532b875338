"""conveyor train's options checked against the model and data, before any worker starts."""

import pytest
import torch

import conveyor.runtime._checkpoint as checkpoint
from conveyor.config import TrainConfig
from conveyor.job import check_against_data
from conveyor.job._config import prediction_leaves_out

MODEL = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def test_a_batch_may_start_above_the_data_only_when_the_tuner_chooses_it() -> None:
    check_against_data(TrainConfig.from_options(batch_size=64), MODEL, samples=64)
    with pytest.raises(ValueError, match="--batch-size 65 is more than the 64 training samples"):
        check_against_data(TrainConfig.from_options(batch_size=65), MODEL, samples=64)
    auto = TrainConfig.from_options(batch_size=65, tune_batch_size=True, job="nightly", target_accuracy=0.9)  # auto=65
    check_against_data(auto, MODEL, samples=64)


def test_microbatches_and_a_checkpoint_must_fit(tmp_path) -> None:
    with pytest.raises(ValueError, match="--microbatches 9 is more than the 8 samples of a batch"):
        check_against_data(TrainConfig.from_options(batch_size=8, microbatches=9), MODEL, samples=64)
    ours = tmp_path / "ours.pt"
    checkpoint.save(ours, MODEL.state_dict())
    check_against_data(TrainConfig.from_options(resume=str(ours)), MODEL, samples=64)
    other = tmp_path / "other.pt"
    checkpoint.save(other, torch.nn.Sequential(torch.nn.Linear(4, 5)).state_dict())
    with pytest.raises(ValueError, match="is from another model"):
        check_against_data(TrainConfig.from_options(resume=str(other)), MODEL, samples=64)


def test_options_fill_the_sections_and_come_back_the_same() -> None:
    from conveyor.config import ElasticConfig, OptimizerConfig, RunConfig, StragglersConfig

    cfg = TrainConfig.from_options(lr=0.1, optimizer="adam", epochs=3, stragglers="slack", slack=2, reliable=None)
    assert cfg.optimizer == OptimizerConfig(name="adam", lr=0.1) and cfg.run == RunConfig(epochs=3)
    assert cfg.stragglers == StragglersConfig(mode="slack", slack=2) and cfg.elastic is None
    assert TrainConfig.from_options(**cfg.options()) == cfg
    assert TrainConfig().options()["stragglers"] == "off" and TrainConfig().stragglers is None
    elastic = TrainConfig.from_options(reliable=2, lost_s=3.0, elastic_layout="pipeline")
    assert elastic.elastic == ElasticConfig(reliable=2, lost_s=3.0, layout="pipeline")
    assert elastic.replaced(epochs=2) == TrainConfig.from_options(
        reliable=2, lost_s=3.0, elastic_layout="pipeline", epochs=2
    )
    with pytest.raises(ValueError, match="conveyor train has no option colour, speed"):
        TrainConfig.from_options(speed=2, colour="red")


def test_each_section_checks_its_own_fields_and_the_config_the_rules_between_them() -> None:
    from conveyor.config import ElasticConfig, EnergyConfig, ModelConfig, OptimizerConfig, RunConfig

    with pytest.raises(ValueError, match="--model-args goes with a module:callable model, not mlp"):
        ModelConfig(args="width=3")
    with pytest.raises(ValueError, match="--model-args 'depth': item 'depth' is not NAME=VALUE: give NAME=VALUE"):
        ModelConfig(name="models:residual", args="depth")
    with pytest.raises(ValueError, match="--max-train-samples must be at least 1, got -3"):
        ModelConfig(max_train_samples=-3)  # it would drop the last 3 samples
    with pytest.raises(ValueError, match="--width must be at least 1, got 0"):
        ModelConfig(width=0)
    with pytest.raises(ValueError, match="--workers must be at least 1, got 0"):
        TrainConfig.from_options(workers=0)  # not the default worker count
    with pytest.raises(ValueError, match="--stages 4 runs on 4 workers but --workers is 2: give --workers 4, or drop"):
        TrainConfig.from_options(workers=2, stages=4)
    with pytest.raises(ValueError, match="--replicas 2-2 runs on 4 workers but --workers is 3"):
        TrainConfig.from_options(workers=3, replicas="2-2")
    with pytest.raises(ValueError, match="--replicas 2-1-1 must give each of the 2 stages a worker count"):
        TrainConfig.from_options(stages=2, replicas="2-1-1")
    with pytest.raises(ValueError, match="--lr must be above 0"):
        OptimizerConfig(lr=float("nan"))
    with pytest.raises(ValueError, match="unknown --stale-rate 'slow': use one of auto, sample, damped"):
        OptimizerConfig(stale_rate="slow")
    with pytest.raises(ValueError, match="--epochs must be at least 1"):
        RunConfig(epochs=0)
    with pytest.raises(ValueError, match="--eta weighs energy against time"):
        EnergyConfig(eta=2.0)
    with pytest.raises(ValueError, match=r"--reliable K .* or --join HOST:PORT, one of them"):
        ElasticConfig()
    with pytest.raises(ValueError, match="--lease bounds the job its worker 0 starts: drop --join"):
        TrainConfig(elastic=ElasticConfig(join="host:29500"), run=RunConfig(lease="lease.json"))
    TrainConfig(elastic=ElasticConfig(reliable=1), run=RunConfig(lease="lease.json"))  # an elastic job may have one
    with pytest.raises(ValueError, match="--materialize 'half': use one of whole, stage"):
        TrainConfig.from_options(materialize="half")
    with pytest.raises(ValueError, match="--materialize stage builds each worker's stage alone, for a fixed pipeline"):
        TrainConfig.from_options(materialize="stage", stragglers="slack")


WAN = {"network": "2:1.25e9,3:6.25e6", "stages": 1, "replicas": "6", "schedule": "flush"}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"wan": "gaia"}, r"^--wan gaia trains across data centres: give --network with the WAN as its outer level"),
        ({**WAN, "network": "6:1.25e9", "wan": "diloco"}, r"^--wan diloco needs two data centres or more"),
        ({**WAN, "network": "2:1.25e9,1:6.25e6", "wan": "gaia"}, r"^--wan gaia needs two data centres or more"),
        ({**WAN, "wan": "gaia", "wan_threshold": 0.0}, r"^--wan-threshold is a relative change in \(0, 1\), got 0"),
        ({**WAN, "wan": "gaia", "wan_threshold": 1.0}, r"^--wan-threshold is a relative change in \(0, 1\), got 1"),
        ({**WAN, "wan": "gaia", "wan_staleness": 0}, r"^--wan-staleness is at least 1 update, got 0"),
        ({**WAN, "wan": "gaia", "wan_period": 0}, r"^--wan-period is at least 1 update, got 0"),
        ({**WAN, "wan": "diloco", "local_steps": 0}, r"^--local-steps must be at least 1"),
        ({**WAN, "wan": "gaia", "schedule": "pipedream"}, r"^--wan gaia: the data centres step together"),
        ({**WAN, "wan": "gaia", "stragglers": "slack"}, r"^--wan gaia runs fixed workers"),
        ({**WAN, "wan": "fast"}, r"^--wan 'fast': use one of off, gaia, diloco"),
        ({**WAN, "wan": "gaia", "wan_estimate": "yes"}, r"^--wan-estimate 'yes': use one of auto, on, off"),
        (
            {**WAN, "wan": "gaia", "materialize": "stage"},
            r"^--wan-estimate auto tries the whole model before training, and --materialize stage never builds it",
        ),
    ],
)
def test_a_bad_wan_setting_is_one_line(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        TrainConfig.from_options(**options)
    assert "\n" not in str(caught.value)


def test_a_wan_mode_on_data_centres_is_accepted() -> None:
    from conveyor.config import WanConfig

    cfg = TrainConfig.from_options(**WAN, wan="gaia", wan_threshold=0.05)
    assert cfg.wan == WanConfig(mode="gaia", threshold=0.05)
    assert TrainConfig.from_options(**cfg.options()) == cfg
    assert cfg.wan.estimate == "auto"  # decided by a pilot before training
    assert TrainConfig.from_options(**WAN, wan="gaia", wan_estimate="off", materialize="stage").wan.estimate == "off"


def test_a_resumed_run_keeps_the_estimate_its_pilot_chose() -> None:
    from conveyor.job._estimate import checkpoint_extras, estimate_from_checkpoint

    auto = TrainConfig.from_options(**WAN, wan="gaia")
    chose_on = estimate_from_checkpoint(auto, {"history": [], "wan_estimate": "on"})
    assert chose_on.wan.estimate == "on" and chose_on.wan.threshold == auto.wan.threshold
    assert checkpoint_extras(chose_on, [{"epoch": 1}]) == {"history": [{"epoch": 1}], "wan_estimate": "on"}
    assert estimate_from_checkpoint(auto, {"history": []}) == auto  # a checkpoint from before: the pilot runs again
    given = TrainConfig.from_options(**WAN, wan="gaia", wan_estimate="off")
    assert estimate_from_checkpoint(given, {"wan_estimate": "on"}) == given  # what the user gives stands
    assert checkpoint_extras(TrainConfig.from_options(), []) == {"history": []}  # no gaia, nothing to keep


def test_a_config_from_when_the_estimate_was_a_switch_still_reads() -> None:
    from conveyor.config import WanConfig

    assert WanConfig(mode="gaia", estimate=True).estimate == "on"  # type: ignore[arg-type]
    assert WanConfig(mode="gaia", estimate=False).estimate == "off"  # type: ignore[arg-type]


def test_a_fixed_layout_for_another_worker_count_is_refused_before_anything_is_measured() -> None:
    """Under torchrun the options cannot name the worker count: the world's size is checked against the layout."""
    from conveyor.job.parts import fixed_layout

    cfg = TrainConfig.from_options(stages=3)
    assert fixed_layout(cfg, 5, 3) is not None and fixed_layout(cfg, 5, 0) is not None  # 0: not known yet
    with pytest.raises(ValueError, match="3 stages with replicas 1-1-1, which need 3 workers, but 2 were started"):
        fixed_layout(cfg, 5, 2)


def test_a_prediction_leaves_out_a_wan_faults_stragglers_and_a_power_limit() -> None:
    """A run that pays one of them misses its prediction by design: no layout ratio is kept from it."""
    assert not prediction_leaves_out(TrainConfig.from_options())
    for options in (
        {"wan": "gaia", "network": "2:1e9,2:1e7", "schedule": "flush"},
        {"power_limit": "200"},
        {"stragglers": "flexrr"},
        {"faults": "pause:worker=1,at=1,for=1"},
    ):
        assert prediction_leaves_out(TrainConfig.from_options(**options)), options
