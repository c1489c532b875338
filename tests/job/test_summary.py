"""A run's summary: typed fields, the JSON of summary.json, the notes it prints, the run folder's one writer."""

import dataclasses
import json
from pathlib import Path

import pytest

from conveyor.errors import InputError
from conveyor.job import ElasticSummary, RunPrediction, RunSummary, steady_rate, write_run_folder


def _summary(
    run_dir: Path,
    *,
    measured: float,
    predicted: float,
    single: float,
    workers: int,
    ran: int | None = None,
    start: dict[str, object] | None = None,
) -> RunSummary:
    """A run's summary: ``workers`` started, ``ran`` of them trained (default: all); ``start``: more start-up
    figures."""
    start = {"single_worker_samples_per_s": single, "workers": workers, **(start or {})}
    return RunSummary(
        run_dir=str(run_dir),
        epochs=2,
        accuracy=[0.5, 0.8],
        loss=[1.0, 0.5],
        seconds=4.0,
        epoch_seconds=[2.0, 4.0],
        epochs_before=0,
        stopped_by_lease=False,
        interrupted=False,
        train_seconds=3.0,
        samples_per_s=measured * 0.9,  # the first epoch warmed up
        steady_samples_per_s=measured,
        bytes_between_servers=None,
        samples=300,
        started_at=0.0,
        peak_rss_bytes=[1, 2],
        layout={"replicas": [1] * (ran or workers)},
        checkpoint=str(run_dir / "checkpoint.pt"),
        prediction=RunPrediction(samples_per_s=predicted, error=measured / predicted - 1, measured_at_start=start),
        energy_j=None,
        epoch_energy_j=[None, None],
        energy_meter=None,
        energy_note=None,
    )


def test_summary_json_has_every_field_and_the_run_folder_gets_it_and_a_plot(tmp_path: Path) -> None:
    summary = _summary(tmp_path, measured=100.0, predicted=80.0, single=50.0, workers=2)
    history = [{"seconds": 2.0, "accuracy": 0.5, "loss": 1.0}, {"seconds": 4.0, "accuracy": 0.8, "loss": 0.5}]
    write_run_folder(summary, history, model="mlp", title="mlp: test accuracy")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert set(written) == {f.name for f in dataclasses.fields(RunSummary)}
    assert written["prediction"]["error"] == 0.25 and written["registered"] is None
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    elastic = ElasticSummary(
        run_dir=str(tmp_path / "e"), epochs=0, accuracy=[], loss=[], seconds=0.0, epoch_seconds=[], generations=[]
    )
    (tmp_path / "e").mkdir()
    write_run_folder(elastic, [], model="mlp", title="no epoch ended")
    assert json.loads((tmp_path / "e" / "summary.json").read_text())["generations"] == []
    assert not (tmp_path / "e" / "accuracy.png").exists()  # no epoch, no plot


def test_notes_say_when_one_worker_would_be_faster(tmp_path: Path) -> None:
    fast = _summary(tmp_path, measured=100.0, predicted=80.0, single=50.0, workers=2)
    assert fast.notes() == ["predicted 80 training samples/s, measured 100 after the first epoch (+25%)"]
    slow = _summary(tmp_path, measured=40.0, predicted=80.0, single=50.0, workers=2)
    assert "this run on 2 workers is measured slower" in slow.notes()[1]
    alone = _summary(tmp_path, measured=40.0, predicted=30.0, single=50.0, workers=1)
    assert len(alone.notes()) == 1  # one worker is the run itself
    planned_alone = _summary(tmp_path, measured=40.0, predicted=30.0, single=50.0, workers=2, ran=1)
    assert len(planned_alone.notes()) == 1  # two started, and the planner ran one: the run is one worker alone


def test_kept_figures_are_missed_beyond_15_percent_or_their_spread_after_a_first_epoch(tmp_path: Path) -> None:
    def run(measured: float, spread: float, *, kept: bool = True, epochs: int = 2) -> RunSummary:
        start = {"spread": spread, "source": "kept from a run on then", "kept_at": "k.json" if kept else None}
        s = _summary(tmp_path, measured=measured, predicted=100.0, single=50.0, workers=1, start=start)
        return dataclasses.replace(s, epochs=epochs)

    assert not run(110.0, 0.05).kept_figures_missed()  # within 15%
    assert run(125.0, 0.05).kept_figures_missed() and run(75.0, 0.05).kept_figures_missed()
    assert not run(125.0, 0.30).kept_figures_missed()  # within the figures' own spread
    assert run(140.0, 0.30).trust_bound() == 0.30 and run(140.0, 0.30).kept_figures_missed()
    assert not run(200.0, 0.05, kept=False).kept_figures_missed()  # measured by this run: nothing to remove
    assert not run(200.0, 0.05, epochs=1).kept_figures_missed()  # one epoch: a cold rate, no steady one
    (note,) = [n for n in run(125.0, 0.05).notes() if "figures" in n]
    assert note.startswith("the start-up figures this run planned from were kept from a run on then; it missed")
    assert "by more than 15%, so they are removed and the next run measures afresh" in note
    assert run(125.0, 0.05).layout_missed() is None  # one worker: its figures go, not a layout's ratio


def test_a_layout_of_more_workers_that_misses_keeps_what_it_measured_over_its_simulation(tmp_path: Path) -> None:
    def run(measured: float, *, before: float = 1.0, key: str | None = "k", epochs: int = 2) -> RunSummary:
        start = {"spread": 0.05, "source": "measured at start-up", "kept_at": None, "key": key}
        s = _summary(tmp_path, measured=measured, predicted=100.0, single=50.0, workers=2, start=start)
        layout = {"schedule": "pipedream", "replicas": [1, 1], "balance": [3, 4], "microbatches": 4}
        plan_file = {"predicted": {"layout_key": "pipedream 1-1 [3, 4] x4", "measured_over_simulated": before}}
        return dataclasses.replace(s, epochs=epochs, layout={**layout, "plan_file": plan_file})

    assert run(80.0).layout_missed() == pytest.approx(0.8) and run(80.0).layout_key() == "pipedream 1-1 [3, 4] x4"
    assert run(80.0, before=0.5).layout_missed() == pytest.approx(0.4)  # predicted at half its simulation already
    assert run(90.0).layout_missed() is None  # within 15%
    assert run(80.0, key=None).layout_missed() is None  # figures not kept: nowhere to keep the ratio
    assert run(80.0, epochs=1).layout_missed() is None
    assert run(10.0).layout_missed() == 0.5 and run(1000.0).layout_missed() == 2.0  # one run halves or doubles it
    assert not run(80.0).kept_figures_missed()  # the figures stay, with the layout's ratio
    vs = run(80.0)
    planned_as = {"predicted": {"layout_key": "pipedream 1-1 [3, 4] x4", "measured_over_simulated": 1.0}}
    vs = dataclasses.replace(vs, layout={**vs.layout, "schedule": "pipedream-vs", "plan_file": planned_as})
    assert vs.layout_key() == "pipedream 1-1 [3, 4] x4"  # under the key the planner looked it up: planned as pipedream
    (note,) = [n for n in run(80.0).notes() if "next plan" in n]
    assert note.endswith("predicts this layout at 0.80 times its simulated rate, as measured here")


def test_a_run_folder_that_holds_a_run_is_refused_unless_overwritten(tmp_path: Path) -> None:
    from conveyor.job import open_run_folder

    folder = tmp_path / "run"
    folder.mkdir()
    assert open_run_folder(str(folder), "mlp", ()) == folder  # an empty folder is the user's to use
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "checkpoint.pt").write_text("ten epochs")
    with pytest.raises(InputError, match=r"--run-dir .*run holds a run \(metrics.jsonl, checkpoint.pt\): give a new"):
        open_run_folder(str(folder), "mlp", ("metrics.jsonl",))
    assert (folder / "metrics.jsonl").read_text() == "{}\n"  # nothing touched
    assert open_run_folder(str(folder), "mlp", ("metrics.jsonl", "elastic.jsonl"), "[run]\n", overwrite=True) == folder
    assert not (folder / "metrics.jsonl").exists() and (folder / "config.toml").read_text() == "[run]\n"


def test_runs_started_together_get_folders_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.job import open_run_folder

    monkeypatch.chdir(tmp_path)  # the default folder is under ./runs
    monkeypatch.setattr("time.strftime", lambda _: "20261129-120000")  # all in one second
    folders = [open_run_folder(None, "pkg.models:tiny", ()) for _ in range(3)]
    names = [f.name for f in folders]
    assert names == [
        "pkg.models-tiny-20261129-120000",
        "pkg.models-tiny-20261129-120000-2",
        "pkg.models-tiny-20261129-120000-3",
    ]
    assert all(f.is_dir() and f.parent == Path("runs") for f in folders)


def test_a_run_that_ends_before_an_epoch_leaves_no_folder_behind(tmp_path: Path) -> None:
    from conveyor.job._summary import discarded_unless_trained

    started = tmp_path / "started"
    started.mkdir()
    (started / "config.toml").write_text("[run]\n")
    (started / "metrics.jsonl").touch()
    with pytest.raises(RuntimeError), discarded_unless_trained(started):
        raise RuntimeError("a worker died while measuring")
    assert not started.exists()
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "metrics.jsonl").write_text('{"epoch": 1}\n')
    with pytest.raises(KeyboardInterrupt), discarded_unless_trained(trained):
        raise KeyboardInterrupt
    assert (trained / "metrics.jsonl").exists()
    with discarded_unless_trained(started := tmp_path / "ok"):
        started.mkdir()
    assert started.exists()  # kept when nothing failed


def test_a_checkpoint_path_is_checked_before_anything_runs(tmp_path: Path) -> None:
    from conveyor.job._summary import check_checkpoint_path

    check_checkpoint_path(str(tmp_path / "new" / "model.pt"))
    assert (tmp_path / "new").is_dir() and not list((tmp_path / "new").iterdir())  # (the probe is gone)
    with pytest.raises(InputError, match="is a folder: give a file's path"):
        check_checkpoint_path(str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(InputError, match=r"--checkpoint .*file/model.pt: .*file is a file, not a folder"):
        check_checkpoint_path(str(tmp_path / "file" / "model.pt"))


def test_train_removes_the_folder_of_a_run_that_failed_while_starting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conveyor.config import TrainConfig
    from conveyor.job import train

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a worker died while measuring")

    monkeypatch.setattr("conveyor.job._train.launch_emulated", fail)
    with pytest.raises(RuntimeError, match="a worker died"):
        train(TrainConfig.from_options(run_dir=str(tmp_path / "run"), workers=1))
    assert not (tmp_path / "run").exists()


def test_the_first_step_whose_loss_is_not_finite_and_the_last_finite_before_it() -> None:
    from conveyor.job._loop import _first_not_finite

    nan, inf = float("nan"), float("inf")
    assert _first_not_finite([2.0, 1.5, nan, 3.0], None) == (3, 1.5)
    assert _first_not_finite([inf], 0.7) == (1, 0.7)  # the epochs' before
    assert _first_not_finite([nan], None) == (1, None)
    assert _first_not_finite([2.0, 1.0], None) == (0, 1.0)
    assert _first_not_finite(None, 0.5) == (0, 0.5)  # off the output worker


def test_the_console_says_whether_the_target_accuracy_was_reached(tmp_path: Path) -> None:
    from conveyor.cli._train import _target_line

    run = dataclasses.replace(
        _summary(tmp_path, measured=1.0, predicted=1.0, single=1.0, workers=1),
        time_to_accuracy_s=4.0,
        epochs_before=3,
    )
    assert _target_line(run, 0.75) == "target accuracy 0.75 reached at epoch 5, 4.0 s: the run stopped there"
    assert _target_line(run, 0.9) == "target accuracy 0.9 not reached in 2 epochs (best 0.800)"


def test_the_steady_rate_leaves_out_the_first_epoch_unless_it_is_the_only_one() -> None:
    assert steady_rate([3.0, 1.0, 1.0], 100) == 100.0  # a cold first epoch three times as long: not counted
    assert steady_rate([3.0, 2.0, 0.5], 100) == 80.0  # two epochs' samples over their 2.5 s
    assert steady_rate([4.0], 100) == 25.0
