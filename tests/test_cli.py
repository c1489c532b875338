"""The conveyor command: the default training run end to end, and one-line errors for bad input."""

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import conveyor.runtime
import conveyor.runtime._checkpoint as checkpoint
from conveyor.cli import _parser, main
from conveyor.cli._common import output_width

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_train_reaches_accuracy_writes_a_checkpoint_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # In this process (the command's own start is test_python_dash_m_conveyor_is_the_command's): a command run
    # as a subprocess spends ~11 s of CPU importing torch in itself and in its worker server before any work.
    ckpt, metrics = tmp_path / "run" / "model.pt", tmp_path / "run" / "metrics.json"
    args = ["train", "--epochs", "3", "--stages", "2", "--checkpoint", str(ckpt), "--json", str(metrics)]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "test accuracy" in out and "training samples/s, measured" in out
    result = json.loads(metrics.read_text())
    assert result["epochs"] == 3 and len(result["accuracy"]) == 3
    assert result["accuracy"][-1] > 0.85, result
    saved = checkpoint.load(ckpt)
    assert saved["steps"] == 3 * -(-1437 // 64)
    assert set(saved["model"]) == {f"{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")}

    from conveyor.config import TrainConfig

    recorded = TrainConfig.from_toml((tmp_path / "run" / "config.toml").read_text())
    given = {"epochs": 3, "stages": 2, "checkpoint": str(ckpt), "run_dir": str(tmp_path / "run")}
    assert recorded == TrainConfig.from_options(**given)

    resumed = ["train", "--config", str(tmp_path / "run" / "config.toml"), "--epochs", "1", "--stages", "3"]
    resumed += ["--replicas", "1-2-1", "--schedule", "pipedream", "--resume", str(ckpt)]  # overriding the file's
    resumed += ["--checkpoint", str(tmp_path / "again.pt"), "--run-dir", str(tmp_path / "again")]
    assert main(resumed) == 0, capsys.readouterr().err
    assert checkpoint.load(tmp_path / "again.pt")["steps"] == 4 * -(-1437 // 64)
    overridden = {"epochs": 1, "stages": 3, "replicas": "1-2-1", "schedule": "pipedream", "resume": str(ckpt)}
    again = {"checkpoint": str(tmp_path / "again.pt"), "run_dir": str(tmp_path / "again")}
    assert TrainConfig.from_toml((tmp_path / "again" / "config.toml").read_text()) == recorded.replaced(
        **overridden, **again
    )


@pytest.mark.slow
def test_train_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    # A synchronous schedule, so that 3 epochs reach the accuracy whichever layout the start-up figures favour
    # (--schedule auto may pick 2bw, whose one-update-old gradients need more epochs on this problem).
    metrics = tmp_path / "metrics.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "conveyor.cli",
        "train",
        "--epochs",
        "3",
        "--schedule",
        "flush",
        "--json",
        str(metrics),
        "--run-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(metrics.read_text())["accuracy"][-1] > 0.8


@pytest.mark.parametrize("rank", ["0", "1"])
def test_torchrun_with_the_wrong_worker_count_fails_in_one_line(
    rank: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker of `torchrun --nproc_per_node 2 -m conveyor.cli train --stages 3`, by the environment torchrun
    # gives it: the check comes before any process group or measurement (real torchrun:
    # test_train_runs_unchanged_under_torchrun).
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for name, value in {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert main(["train", "--stages", "3", "--epochs", "1", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("conveyor: error: the pipeline has 3 stages with replicas 1-1-1, which need 3 workers, ")
    assert err.count("\n") == 1 and "but 2 were started: start 3 (torchrun --nproc_per_node 3)" in err
    assert not (tmp_path / "run").exists()  # nothing started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--resume", "/no/such/ckpt.pt"], "no checkpoint at /no/such/ckpt.pt: check the path"),
        (["train", "--stages", "6"], "cannot cut 5 blocks into 6 stages"),
        (["train", "--stages", "2", "--replicas", "2"], "--replicas 2 must give each of the 2 stages a worker count"),
        (["train", "--model", "vgg19"], "unknown model 'vgg19': use one of gpt, gpt2, mlp, resnet, resnet18, vgg"),
        (["train", "--model", "models:not_a_model"], r"must return (model, example_batch)"),
        (["train", "--model", "gpt", "--dataset", "digits"], "gpt is a language model"),
        (["train", "--model", "mlp", "--dataset", "digit-images"], "mlp takes feature vectors (N, F), and digit-im"),
        (["train", "--model", "models:residual", "--model-args", "depth=2,,width"], "item 2 is empty (two commas"),
        (["train", "--plan", "PLAN", "--workers", "3"], "is for 2 workers but the job has 3"),
        (["train", "--resume", "NOT_A_CHECKPOINT"], "NOT_A_CHECKPOINT"),
        (["train", "--replicas", "two-1"], "--replicas 'two-1' is not a list of counts like 2-1"),
        (["train", "--workers", "2", "--stages", "4"], "--stages 4 runs on 4 workers but --workers is 2: give --w"),
        (["train", "--workers", "3", "--replicas", "2-2"], "--replicas 2-2 runs on 4 workers but --workers is 3"),
        (["train", "--workers", "5", "--replicas", "2-1"], "--replicas 2-1 runs on 3 workers but --workers is 5"),
        (
            ["train", "--run-dir", "HELD", "--epochs", "1"],
            "held holds a run (summary.json): give a new folder, or --o",
        ),
        (["train", "--checkpoint", "NOT_A_CHECKPOINT/x.pt"], "NOT_A_CHECKPOINT is a file, not a folder"),
        (["train", "--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1], got 1.5"),
        (["train", "--target-accuracy", "0"], "--target-accuracy must be in (0, 1], got 0.0"),
        (["train", "--resume", "BINARY"], "is not a readable checkpoint (UnpicklingError"),
        (["bench", "schedules", "--forward-ms", "0", "--backward-ms", "0"], "not both 0"),
        (["train", "--workers", "4", "--network", "3:1e9"], "--network 3:1e9 has 3 workers but the job has 4"),
        (["train", "--devices", "1,fast"], "cannot read device 'fast' of --devices '1,fast'"),
        (
            ["train", "--devices", "1", "--cpu-slice", "2"],
            "--cpu-slice is 0.001 to 1 second (the kernel's quota), got 2",
        ),
        (["train", "--workers", "4", "--faults", "pause:worker=9,at=1,for=1"], "worker=9 is out of range: this job's"),
        (["emulate", "check"], "conveyor emulate check needs --network, --devices or both"),
        (["train", "--stragglers", "flexrr", "--slack", "0"], "--stragglers flexrr needs --slack of at least 1, got 0"),
        (["bench", "stragglers", "--patterns", "slow-worker"], "the patterns must include none"),
        (["train", "--device", "cpu", "--backend", "nccl"], "NCCL joins GPUs, and this job runs on the CPU: use --"),
        (["bench", "overhead", "--models", "vgg19"], "unknown models ['vgg19']: choose from mlp, vgg16, gpt"),
        (["train", "--lr", "-1"], "--lr must be above 0 and --momentum in [0, 1); got -1.0 and 0.9"),
        (["train", "--momentum", "1"], "--lr must be above 0 and --momentum in [0, 1); got 0.05 and 1.0"),
        (["train", "--batch-size", "5000"], "--batch-size 5000 is more than the 1437 training samples: use at most"),
        (["train", "--microbatches", "128"], "--microbatches 128 is more than the 64 samples of a batch: use at most"),
        (["train", "--model", "models.factory"], "(a factory is named with a colon: models:factory)"),
        (["train", "--reliable", "1", "--checkpoint-every", "2"], "--checkpoint-every saves a run of fixed workers"),
        (["train", "--resume", "OTHER_MODEL"], "OTHER_MODEL is from another model (missing 0.bias, 0.weight, 2.bias"),
        (
            ["train", "--materialize", "stage", "--stragglers", "slack"],
            "--materialize stage builds each worker's stage",
        ),
        (["train", "--model", "mlp", "--dataset", "hf:MASKED"], "one input tensor is needed for the zoo's models"),
        (
            ["train", "--model", "models:residual", "--dataset", "hf:MASKED", "--batch-size", "4", "--reliable", "1"],
            "for an elastic job",
        ),
    ],
)
def test_bad_input_is_one_line_without_traceback(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stages = [{"first_layer": 0, "last_layer": 2, "replicas": 1}, {"first_layer": 3, "last_layer": 4, "replicas": 1}]
    plan = {"schedule": "flush", "microbatches": 4, "stages": stages}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "NOT_A_CHECKPOINT").write_text("hello")
    (tmp_path / "BINARY").write_bytes(bytes(range(256)) * 4)  # like /etc/hostname: torch.load's message is long
    checkpoint.save(tmp_path / "OTHER_MODEL", {"weight": torch.zeros(2)})
    (tmp_path / "held").mkdir()
    (tmp_path / "held" / "summary.json").write_text("{}")  # a run's, which a new run would replace
    paths = {name: str(tmp_path / name) for name in ("NOT_A_CHECKPOINT", "BINARY", "OTHER_MODEL")}
    paths |= {"HELD": str(tmp_path / "held"), "NOT_A_CHECKPOINT/x.pt": str(tmp_path / "NOT_A_CHECKPOINT" / "x.pt")}
    paths["PLAN"] = str(tmp_path / "plan.json")
    if any("MASKED" in a for a in args):
        datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed")
        masked = {"input_ids": [[1, 2]] * 10, "attention_mask": [[1, 1]] * 10, "label": list(range(10))}
        datasets.Dataset.from_dict(masked).save_to_disk(str(tmp_path / "masked"))
        capsys.readouterr()  # (its progress bar)
    paths["hf:MASKED"] = f"hf:{tmp_path / 'masked'}"
    assert main([paths.get(a, a) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert (tmp_path / "held" / "summary.json").read_text() == "{}" and not (tmp_path / "held" / "config.toml").exists()


def test_help_shows_defaults_and_the_version_is_there(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # the help folds lines at the terminal's width
    assert "--lr LR learning rate, above 0 (default: 0.05)" in text
    assert "--seed SEED initial weights, data order and dropout (default: 0)" in text
    assert "(default: True)" not in text  # a flag's default reads backwards: not shown
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("conveyor 0.")


@pytest.mark.slow
def test_python_dash_m_conveyor_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor", "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0 and done.stdout.startswith("conveyor 0."), done.stderr[-2000:]


def test_go_on_command_drops_the_old_resume_and_epochs() -> None:
    from conveyor.cli._train import _without

    argv = ["train", "--epochs", "9", "--resume=a.pt", "--model", "vgg", "--resume", "b.pt", "--epochs=3"]
    assert _without(argv, "--resume", "--epochs") == ["train", "--model", "vgg"]


def test_unknown_schedule_is_rejected_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["train", "--schedule", "zigzag"])
    assert info.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a CUDA GPU")
def test_cuda_where_there_is_none_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", "--device", "cuda", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        "conveyor: error: --device cuda: this machine has no CUDA GPU that PyTorch can use: use --device cpu\n"
    )
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.slow
def test_bench_schedules_writes_its_report(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = [
        "bench",
        "schedules",
        "--stages",
        "2",
        "--microbatches",
        "2",
        "--steps",
        "2",
        "--forward-ms",
        "2",
        "--backward-ms",
        "4",
        "--repeats",
        "1",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["config"]["stages"] == 2 and report["config"]["repeats"] == 1
    assert all(len(r["wall_s_per_repeat"]) == 1 for r in report["results"].values())
    conveyor = {f"conveyor/{n}" for n in ("gpipe", "flush", "pipedream", "pipedream-vs", "2bw", "dp")}
    assert set(report["results"]) == conveyor | {"torch/gpipe", "torch/1f1b"}


def test_profile_then_plan(tmp_path: Path, pipedream_profiles: Path) -> None:
    prof = tmp_path / "mlp.json"
    assert main(["profile", "mlp", "--batch-size", "16", "--repeats", "2", "--json", str(prof)]) == 0
    assert main(["plan", str(prof), "--topology", "2:1e9", "--straight", "--json", str(tmp_path / "p.json")]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert [s["replicas"] for s in plan["stages"]] == [1, 1]
    assert [r for s in plan["stages"] for r in s["ranks"]] == [0, 1]
    assert sum(len(s["layer_names"]) for s in plan["stages"]) == 5

    args = ["profile", "mlp", "--batch-size", "16", "--batch-sizes", "4,8", "--repeats", "2", "--json", str(prof)]
    assert main(args) == 0
    args = ["plan", str(prof), "--topology", "2:1e9", "--schedule", "2bw", "--batch-size", "32"]
    assert main([*args, "--json", str(tmp_path / "p.json")]) == 0
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["schedule"] == "2bw" and plan["microbatch_size"] in (4, 8, 16)
    assert plan["microbatches"] * plan["microbatch_size"] == 32

    out = tmp_path / "vgg.json"
    assert main(["plan", str(pipedream_profiles / "vgg16"), "--topology", "16:1.25e9", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["config"] == "15-1" and plan["noam"] == 2 and plan["schedule"] == "pipedream"
    assert set(plan["predicted"]) >= {"samples_per_s", "speedup_vs_dp", "speedup_vs_single"}

    args = ["--topology", "16:1.25e9", "--memory", "8e9", "--schedule", "2bw", "--json", str(out)]
    assert main(["plan", str(pipedream_profiles / "vgg16"), *args]) == 0
    plan = json.loads(out.read_text())
    assert plan["schedule"] == "2bw" and plan["memory_limit_bytes"] == 8e9
    assert all(0 < s["memory_bytes"] <= 8e9 for s in plan["stages"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "/no/profile.json", "--topology", "2:1e9"], "no profile at /no/profile.json"),
        (["plan", "PROFILE", "--topology", "2"], "cannot read topology level '2'"),
        (["plan", "PROFILE", "--topology", "9:1e9", "--straight"], "use at most 5 workers"),
        (["plan", "PROFILE", "--topology", "2:1e9", "--memory", "1"], "the least that fits is about"),
        (["plan", "PROFILE", "--topology", "2:1e9", "--batch-size", "8"], "use it with --schedule 2bw"),
        (["profile", "nosuchmodel", "--json", "x.json"], "unknown model 'nosuchmodel'"),
    ],
)
def test_bad_plan_and_profile_input(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conveyor.plan._profiles import Profile

    Profile.chain("five", forward_s=[1.0] * 5, backward_s=[1.0] * 5, output_bytes=[1] * 5, param_bytes=[1] * 5).save(
        tmp_path / "p.json"
    )
    assert main([a.replace("PROFILE", str(tmp_path / "p.json")) for a in args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.slow
def test_a_model_built_on_meta_is_profiled_a_block_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``conveyor profile --materialize stage``: each block made real in turn, and the same blocks, weights and
    outputs as the model built whole."""
    made: list[list[str]] = []
    original = conveyor.runtime.initialise_from

    def counted(model: torch.nn.Module, *, seed: int) -> Any:
        materialize = original(model, seed=seed)
        return lambda stage, device: (made.append([n for n, _ in stage.named_children()]), materialize(stage, device))

    monkeypatch.setattr(conveyor.runtime, "initialise_from", counted)
    profiles = {}
    for how in ("whole", "stage"):
        path = tmp_path / f"{how}.json"
        args = ["profile", "models:residual", "--materialize", how, "--repeats", "2", "--json", str(path)]
        assert main(args) == 0
        profiles[how] = json.loads(path.read_text())["layers"]
    for key in ("name", "param_bytes", "output_bytes", "saved_bytes", "optimizer_bytes"):
        assert [layer[key] for layer in profiles["stage"]] == [layer[key] for layer in profiles["whole"]], key
    assert made == [[layer["name"]] for layer in profiles["stage"]]  # one block at a time, each once


def test_bench_planner_writes_its_report() -> None:
    from conveyor.bench import planner

    report = planner.run(layer_counts=(8,), worker_counts=(16,))
    assert report["results"][0]["workers"] == 16 and report["results"][0]["seconds"] > 0
    assert sum(int(r) for r in report["results"][0]["config"].split("-")) == 16


@pytest.mark.parametrize("command", [["train"], ["bench", "stragglers"]])
def test_chunks_are_a_count_or_auto(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _parser().parse_args([*command, "--chunks", "auto"]).chunks == "auto"
    assert _parser().parse_args([*command, "--chunks", "3"]).chunks == 3
    for bad, message in (("0", "must be at least 1, got 0"), ("²", "a whole number of at least 1, or auto, not '²'")):
        with pytest.raises(SystemExit):
            _parser().parse_args([*command, "--chunks", bad])
        assert message in capsys.readouterr().err


def test_a_bug_keeps_its_traceback_and_bad_input_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only an InputError (or an OSError) is bad input; a ValueError from anything else, torch included, is a bug."""
    import conveyor.cli._plan as plan_command
    from conveyor.errors import InputError
    from conveyor.runtime import WorkerError

    def raising(exc: Exception) -> Callable[[object], None]:
        def run(_: object) -> None:
            raise exc

        return run

    monkeypatch.setattr(plan_command, "plan", raising(ValueError("a bug")))
    with pytest.raises(ValueError, match="a bug"):
        main(["plan", "PROFILE", "--topology", "2:1e9"])
    monkeypatch.setattr(plan_command, "plan", raising(InputError("bad --thing: use 3")))
    assert main(["plan", "PROFILE", "--topology", "2:1e9"]) == 2
    assert capsys.readouterr().err == "conveyor: error: bad --thing: use 3\n"
    for bad_input in (True, False):
        failed = WorkerError(1, "KeyError", "'x'", "Traceback (most recent call last):\n  ...", bad_input=bad_input)
        monkeypatch.setattr(plan_command, "plan", raising(failed))
        assert main(["plan", "PROFILE", "--topology", "2:1e9"]) == 1
        err = capsys.readouterr().err
        assert err.endswith("conveyor: error: worker 1: KeyError: 'x'\n")
        assert ("Traceback" in err) is not bad_input  # a worker's bug shows where it happened


@pytest.mark.slow
def test_a_run_whose_loss_diverges_stops_and_keeps_the_good_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.pt"
    good.write_bytes(b"an earlier run's model")
    run = tmp_path / "run"
    args = ["train", "--lr", "1e6", "--epochs", "3", "--workers", "1", "--run-dir", str(run), "--checkpoint", str(good)]
    assert main(args) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("conveyor: error:")]
    assert len(errors) == 1 and "the training loss stopped being finite at epoch 1, step" in errors[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["diverged"]["epoch"] == summary["epochs"] == 1 and summary["diverged"]["step"] >= 1
    assert good.read_bytes() == b"an earlier run's model"  # not replaced by non-finite weights


@pytest.mark.slow
def test_a_model_with_a_padded_vocabulary_trains_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", "--model", "models:TokenMixer", "--model-args", "vocab=101,causal=True,outputs=128"]
    args += ["--dataset", "text", "--epochs", "1", "--workers", "1", "--max-train-samples", "256"]
    assert main([*args, "--run-dir", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "models:TokenMixer scores 128 classes and text has 101: the other 27 are never a target" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["epochs"] == 1


def test_tables_written_to_a_file_or_pipe_are_not_cut_to_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    class Pipe:
        def isatty(self) -> bool:
            return False

    monkeypatch.setattr(sys, "stdout", Pipe())
    monkeypatch.delenv("COLUMNS", raising=False)
    assert output_width() == 160
    monkeypatch.setenv("COLUMNS", "100")  # the user's own width stands
    assert output_width() is None
