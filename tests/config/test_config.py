"""conveyor train's configuration: every field defined once (the parser is made from the sections), the run's
config.toml round-trips every field, and --config reads it with the command line's options on top."""

from pathlib import Path
from typing import Any

import pytest

from conveyor.cli import _parser
from conveyor.cli._train import _train_config
from conveyor.config import OPTION_FIELDS, TrainConfig, read_config_file
from conveyor.errors import InputError

# A value other than the default for every option, in groups that may go together (an elastic job plans its own
# layout; a recurrence of --batch-size auto runs whole; a warm start is not a resume; --wan runs fixed workers).
FIXED = {
    "model": "models:residual",
    "model_args": "depth=3",
    "dataset": "synthetic:8:4:64",
    "width": 32,
    "depth": 3,
    "max_train_samples": 48,
    "workers": 3,
    "schedule": "2bw",
    "stages": 2,
    "replicas": "2-1",
    "microbatches": 2,
    "remeasure": True,
    "trial": False,
    "optimizer": "adam",
    "lr": 0.01,
    "momentum": 0.5,
    "batch_size": 32,
    "stale_correction": False,
    "stale_rate": "damped",
    "epoch_factors": "factors.json",
    "epochs": 3,
    "target_accuracy": 0.9,
    "run_dir": "runs/x",
    "overwrite": True,
    "checkpoint": "x.pt",
    "checkpoint_every": 2,
    "seed": 7,
    "device": "cpu",
    "backend": "gloo",
    "autocast": "bf16",
    "torch_profile": "prof",
    "loader_workers": 2,
    "resources_every": 1.5,
    "devices": "1,1,0.5",
    "faults": "pause:worker=1,at=1,for=1",
    "cpu_slice": 0.01,
    "energy_meter": "off",
    "power_limit": "250",
    "eta": 0.3,
    "tune_batch_size": True,
    "job": "nightly",
    "recurrences": "r.sqlite",
    "beta": 3.0,
    "max_power": 300.0,
    "stragglers": "slack",
    "slack": 2,
    "chunks": "auto",
    "equal_shares": True,
    "store": "store",
    "register": True,
}
ELASTIC = {"reliable": 1, "lost_s": 3.0, "backup_every": 2, "sync_max": 1.5, "backup_only_min": 4.0}
ELASTIC |= {"elastic_layout": "pipeline", "lease": "lease.json", "warm_start": None}
OTHERS = {"warm_start": "auto", "plan": "plan.json", "join": None}
WAN = {"network": "2:1.25e9,2:6.25e6", "schedule": "flush", "replicas": "4", "stages": 1}
WAN |= {"wan": "gaia", "wan_threshold": 0.01, "wan_staleness": 2, "wan_period": 3, "wan_estimate": "on"}
WAN |= {"local_steps": 8, "outer_lr": 0.5}
JOIN = {"join": "host:29500"}
STAGE = {"materialize": "stage", "resume": "x.pt", "stages": 2}
CONFIGS = [FIXED, ELASTIC, OTHERS, WAN, JOIN, STAGE]


def test_every_option_has_a_value_other_than_its_default_here() -> None:
    changed = {name for options in CONFIGS for name, value in options.items() if value is not None}
    assert changed == set(OPTION_FIELDS)


@pytest.mark.parametrize("options", CONFIGS, ids=["fixed", "elastic", "plan-and-warm-start", "wan", "join", "stage"])
def test_config_toml_round_trips_every_field(options: dict[str, Any]) -> None:
    given = {name: value for name, value in options.items() if value is not None}
    if "plan" in given:  # a plan file fixes the layout: no stages nor replicas beside it
        given = {name: value for name, value in given.items() if name not in ("stages", "replicas")}
    cfg = TrainConfig.from_options(**given)
    assert {name: cfg.options()[name] for name in given} == given
    assert TrainConfig.from_toml(cfg.to_toml()) == cfg


def test_every_option_is_parsed_into_its_field() -> None:
    """The parser is made from the sections: each option given on the command line lands in its field."""
    words = {False: [], True: []}
    for name, value in FIXED.items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(value, bool):
            words[True].append(f"--no-{flag[2:]}" if not value else flag)
        else:
            words[False] += [flag, str(value)]
    argv = ["train", *words[False], *[w for w in words[True] if w != "--tune-batch-size"]]
    argv[argv.index("--batch-size") + 1] = "auto=32"  # what sets tune_batch_size
    assert _train_config(_parser().parse_args(argv)) == TrainConfig.from_options(**FIXED)


def test_the_command_line_overrides_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[run]\nepochs = 5\n\n[optimizer]\nlr = 0.1\nname = "adam"\n')
    cfg = _train_config(_parser().parse_args(["train", "--config", str(path), "--epochs", "2"]))
    assert (cfg.run.epochs, cfg.optimizer.lr, cfg.optimizer.name) == (2, 0.1, "adam")
    assert cfg.replaced(epochs=10, lr=0.05, optimizer="sgd") == TrainConfig()  # the rest at the defaults


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[colour]\nred = 1\n", r"^C: no section \[colour\]; the sections are model, layout, "),
        ("[run]\nepoch = 1\n", r"^C: \[run\] has no field 'epoch'; its fields are epochs, target_accuracy, "),
        ("[run\n", r"^C is not TOML: "),
        ("[run]\nepochs = 0\n", r"^--epochs must be at least 1, got 0$"),
    ],
)
def test_a_bad_config_file_is_one_line(text: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "C"
    path.write_text(text)
    with pytest.raises(InputError, match=message.replace("C", str(path).replace("/", r"\/"), 1)):
        TrainConfig.from_options(**read_config_file(str(path)))
    with pytest.raises(InputError, match=r"^--config .*none\.toml: cannot read it"):
        read_config_file(str(tmp_path / "none.toml"))


@pytest.mark.parametrize(
    ("dataset", "model"),
    [
        (None, "mlp"),
        ("text", "gpt"),
        ("text:notes.txt", "gpt"),
        ("synthetic-text", "gpt"),
        ("imagefolder:~/pics", "resnet"),
        ("torchvision:CIFAR10:data", "resnet"),
        ("synthetic:3x32x32:10:100", "resnet"),
        ("synthetic:16:4:100", "mlp"),
        ("hf:folder", "mlp"),
    ],
)
def test_the_model_left_out_is_named_by_the_dataset(dataset: str | None, model: str) -> None:
    cfg = TrainConfig.from_options(dataset=dataset)
    assert cfg.model.name == model
    assert TrainConfig.from_toml(cfg.to_toml()) == cfg  # config.toml names the model, not "auto"
    assert TrainConfig.from_options(model="vgg", dataset=dataset).model.name == "vgg"  # one given is kept
