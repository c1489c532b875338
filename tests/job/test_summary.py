"""A run's summary: typed fields, the JSON of summary.json, the notes it prints, the run folder's one writer."""

import dataclasses
import json
from pathlib import Path

import pytest

from conveyor.job import ElasticSummary, RunPrediction, RunSummary, write_run_folder


def _summary(run_dir: Path, *, measured: float, predicted: float, single: float, workers: int) -> RunSummary:
    start = {"single_worker_samples_per_s": single, "workers": workers}
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
        samples_per_s=measured,
        bytes_between_servers=None,
        samples=300,
        started_at=0.0,
        peak_rss_bytes=[1, 2],
        layout={"replicas": [1, 1]},
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
    assert fast.notes() == ["predicted 80 training samples/s, measured 100 (+25%)"]
    slow = _summary(tmp_path, measured=40.0, predicted=80.0, single=50.0, workers=2)
    assert "this run on 2 workers is measured slower" in slow.notes()[1]
    alone = _summary(tmp_path, measured=40.0, predicted=30.0, single=50.0, workers=1)
    assert len(alone.notes()) == 1  # one worker is the run itself


def test_a_run_folder_used_again_starts_its_logs_afresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.job import open_run_folder

    monkeypatch.chdir(tmp_path)  # the default folder is under ./runs

    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("{}\n")
    (folder / "checkpoint.pt").write_text("kept")
    assert open_run_folder(str(folder), "mlp", ("metrics.jsonl", "elastic.jsonl")) == folder
    assert not (folder / "metrics.jsonl").exists() and (folder / "checkpoint.pt").read_text() == "kept"
    named = open_run_folder(None, "pkg.models:tiny", ())
    assert named.is_dir() and named.parent == Path("runs") and named.name.startswith("pkg.models-tiny-")
