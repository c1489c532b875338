"""The start-up figures kept between runs: keyed by what they depend on, read back whole, and planned from to the
same plan every time."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config import TrainConfig
from conveyor.job import RunSummary, train
from conveyor.job._costs import Costs
from conveyor.job._layout import Layout, choose_layout, fixed_layout
from conveyor.job._measured import correct_layout, costs_key, kept_or_measured, load_costs, save_costs
from conveyor.plan import Level, Plan, PlannedStage, Profile, Topology, layout_key, predict
from conveyor.plan._profiles import Layer
from conveyor.runtime import MeasuredLink, launch

CPU = torch.device("cpu")


TWO_SERVERS = Topology((Level(2, 1e9), Level(2, 1e8, 1e-3)))


def _costs(workers: int = 4, network: Topology | None = TWO_SERVERS) -> Costs:
    layers = tuple(
        Layer(
            str(i), "Linear", forward_s=1e-3 * (i + 1), backward_s=2e-3 * (i + 1), output_bytes=4096, param_bytes=8192
        )
        for i in range(6)
    )
    profile = Profile("toy", layers, tuple((i, i + 1) for i in range(5)), 16)
    link = MeasuredLink(send_s=2e-5, recv_s=1e-5, latency=5e-5, bandwidth=1e9)
    return Costs(profile, link, (1e-4, 2e9), 3e-5, 900.0, workers, 2, network, spread=0.04)


def _model(width: int = 8) -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


BATCH = (torch.zeros(16, 4), torch.zeros(16, dtype=torch.long))


def test_the_key_follows_the_model_the_batch_and_the_job_and_nothing_else() -> None:
    key = costs_key(_model(), BATCH, device=CPU, job={"workers": 2})
    assert key == costs_key(_model(), BATCH, device=CPU, job={"workers": 2})  # other weights, same model
    assert key != costs_key(_model(width=9), BATCH, device=CPU, job={"workers": 2})
    assert key != costs_key(_model(), (torch.zeros(32, 4), BATCH[1]), device=CPU, job={"workers": 2})
    assert key != costs_key(_model(), BATCH, device=CPU, job={"workers": 3})


def test_kept_figures_read_back_whole_and_a_bad_file_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path))
    assert load_costs("k") is None
    costs = replace(_costs(), update_factors=(1.5, 3.25), stashed_forward_factor=1.125)
    save_costs("k", costs)
    kept = load_costs("k")
    assert kept is not None and kept.source.startswith("kept from a run on ") and "--remeasure" in kept.source
    assert kept.kept_at == str(tmp_path / "cache" / "costs" / "k.json")
    assert kept.key == "k" and replace(kept, source=costs.source, kept_at=None, key=None) == costs
    assert [p.name for p in (tmp_path / "cache" / "costs").iterdir()] == ["k.json"]  # nothing half-written left
    (tmp_path / "cache" / "costs" / "k.json").write_text('{"profile": {}}')
    assert load_costs("k") is None
    text = json.loads(costs.to_json())
    (tmp_path / "cache" / "costs" / "k.json").write_text(json.dumps({**text, "layout_ratios": None}))
    assert load_costs("k") is None  # a hand-edited file: measured again
    # Figures kept before the update was measured lack its factors: they are measured again.
    for figure in ("update_factors", "stashed_forward_factor"):
        text = json.loads(costs.to_json())
        del text[figure]
        (tmp_path / "cache" / "costs" / "k.json").write_text(json.dumps(text))
        assert load_costs("k") is None


def test_two_plannings_from_the_same_kept_figures_give_the_same_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path))
    save_costs("k", _costs())
    cfg = TrainConfig.from_options(workers=4)
    plans = []
    for _ in range(2):
        kept = load_costs("k")
        assert kept is not None
        plans.append(choose_layout(cfg, names=[str(i) for i in range(6)], costs=kept, batches=20, samples=1280))
    assert plans[0] == plans[1] and plans[0].plan_file == plans[1].plan_file
    assert plans[0].plan_file["measured_at_start"]["source"].startswith("kept from a run on ")


def test_planned_among_measured_layouts_only_the_fastest_measured_one_is_chosen() -> None:
    """After its trials, a job runs no untried pipeline: of the layouts with a ratio on the figures, the fastest."""
    cfg, names = TrainConfig.from_options(workers=4), [str(i) for i in range(6)]
    costs = _costs(network=None)
    first = choose_layout(cfg, names=names, costs=costs, batches=20, samples=1280)
    candidates = first.plan_file["candidates"]
    assert len(candidates) >= 3 and candidates[0]["layout_key"] == first.plan_file["predicted"]["layout_key"]
    slower, slowest = candidates[1]["layout_key"], candidates[2]["layout_key"]
    ratios = {slower: 0.9, slowest: 0.5}  # tried: both measured under their simulation; the fastest never was
    measured = replace(costs, layout_ratios=ratios)
    assert (
        choose_layout(cfg, names=names, costs=measured, batches=20, samples=1280).plan_file["predicted"]["layout_key"]
        == first.plan_file["predicted"]["layout_key"]
    )  # planned freely, the untried one still leads
    only = choose_layout(cfg, names=names, costs=measured, batches=20, samples=1280, measured_only=True)
    assert only.plan_file["predicted"]["layout_key"] == slower
    assert [c["layout_key"] for c in only.plan_file["candidates"]] == [slower, slowest]
    assert "the fastest of 2 measured layouts simulated" in only.how


def test_a_layout_a_run_measured_off_its_simulation_is_predicted_as_measured_next_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path))
    save_costs("k", _costs(network=None))
    cfg, names = TrainConfig.from_options(), [str(i) for i in range(6)]

    def planned() -> Layout:
        kept = load_costs("k")
        assert kept is not None
        return choose_layout(cfg, names=names, costs=kept, batches=20, samples=1280)

    first = planned()
    assert sum(first.replicas) > 1 and first.plan_file["predicted"]["measured_over_simulated"] == 1.0
    key = layout_key(first.schedule, first.replicas, first.balance, first.microbatches)
    assert first.plan_file["predicted"]["layout_key"] == key  # what the planner looked its ratio up under
    kept_path = tmp_path / "cache" / "costs" / "k.json"
    os.utime(kept_path, (1_000_000_000, 1_000_000_000))  # measured long ago
    correct_layout("k", key, 0.25)  # its run measured a quarter of its simulated rate
    assert kept_path.stat().st_mtime == 1_000_000_000  # still the figures' date, not the correction's
    second = planned()
    assert second.plan_file["measured_at_start"]["layout_ratios"] == {key: 0.25}
    entry = next(c for c in second.plan_file["candidates"] if c["measured_over_simulated"] == 0.25)
    assert (entry["schedule"], entry["balance"], entry["microbatches"]) == (
        first.schedule,
        first.balance,
        first.microbatches,
    )
    assert (second.schedule, second.replicas, second.balance) != (first.schedule, first.replicas, first.balance)
    # Run as a fixed layout, it is predicted as measured too.
    kept = load_costs("k")
    assert kept is not None
    fixed = choose_layout(cfg, names=names, costs=kept, batches=20, samples=1280, layout=first)
    assert fixed.predicted_samples_per_s == pytest.approx(first.predicted_samples_per_s * 0.25)
    assert (
        "at 0.25 times its simulated rate (what a trial or an earlier run measured on these figures)"
        in fixed.describe()
    )
    correct_layout("gone", key, 0.5)  # figures removed meanwhile: nothing is written
    assert not (tmp_path / "cache" / "costs" / "gone.json").exists()


def test_the_planner_may_choose_fewer_workers_than_started_and_says_which_it_simulated() -> None:
    costs = _costs(network=None)  # one machine's workers: one level
    cfg = TrainConfig.from_options()
    names = [str(i) for i in range(6)]
    planned = [
        choose_layout(cfg, names=names, costs=costs, batches=20, samples=1280, fewer=fewer) for fewer in (False, True)
    ]
    on_all = planned[0].plan_file["candidates"]
    assert {c["workers"] for c in on_all} == {4} and sum(planned[0].replicas) == 4
    shortlist = planned[1].plan_file["candidates"]
    assert {c["workers"] for c in shortlist} == {1, 2, 3, 4} and len(shortlist) == 8  # the fastest 8 of 13
    first = shortlist[0]
    assert (sum(planned[1].replicas), planned[1].schedule, planned[1].microbatches) == (
        first["workers"],
        first["schedule"],
        first["microbatches"],
    )
    speed = [c["samples_per_s"] / c["epochs_factor"] for c in shortlist]
    assert speed == sorted(speed, reverse=True)
    progress = [p.plan_file["predicted"]["samples_per_s"] / p.plan_file["predicted"]["epochs_factor"] for p in planned]
    assert progress[1] >= progress[0] / 1.001  # never slower to accuracy than the best on all the workers
    assert "varied" not in planned[1].describe()
    noisy = choose_layout(cfg, names=names, costs=replace(costs, spread=0.9), batches=20, samples=1280, fewer=True)
    assert "The start-up figures varied 90% around their median" in noisy.describe()
    assert sum(noisy.replicas) <= sum(planned[1].replicas)  # within the noise, the fewest workers


def _figures(remeasure: bool) -> str | None:
    torch.manual_seed(0)
    batches = [(torch.randn(64, 4), torch.randint(0, 3, (64,))) for _ in range(2)]
    costs = kept_or_measured(
        TrainConfig.from_options(workers=2, remeasure=remeasure),
        _model(),
        batches,
        microbatches=4,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        device=CPU,
        share=None,
        name="toy",
    )
    return None if costs is None else costs.source


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_measures_once_then_plans_from_what_it_kept_until_told_to_remeasure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path))
    sources = [launch(_figures, remeasure, nprocs=2, timeout_s=100) for remeasure in (False, False, True)]
    assert [s[1] for s in sources] == [None, None, None]  # the first worker's alone
    first, second, third = (s[0] for s in sources)
    assert first == third == "measured at start-up" and second is not None and second.startswith("kept from")
    assert len(list((tmp_path / "cache" / "costs").iterdir())) == 1


def test_the_stale_rate_follows_the_measured_table_unless_asked(tmp_path: Path) -> None:
    """``--stale-rate auto`` takes the rule the convergence table measured faster for the model and schedule, and
    the plan prices and records it; a rule asked for is used as is; a synchronous schedule has none."""
    report = {
        "epoch_factors": {"toy": {"dp": 1.0, "pipedream": 1.5, "pipedream/damped": 0.75}},
        "stale_rates": {"toy": {"pipedream": "damped"}},
    }
    (tmp_path / "f.json").write_text(json.dumps(report))
    names = [str(i) for i in range(6)]

    def planned(**options: object) -> Layout:
        cfg = TrainConfig.from_options(workers=4, epoch_factors=str(tmp_path / "f.json"), **options)
        fixed = fixed_layout(cfg, 6, 4)  # None: the planner's
        return choose_layout(cfg, names=names, costs=_costs(), batches=20, samples=1280, layout=fixed)

    auto, sample = planned(schedule="pipedream"), planned(schedule="pipedream", stale_rate="sample")
    assert (auto.stale_rate, auto.plan_file["stale_rate"], auto.plan_file["predicted"]["epochs_factor"]) == (
        "damped",
        "damped",
        0.75,
    )
    assert "damped learning rate" in auto.describe()
    assert (sample.stale_rate, sample.plan_file["stale_rate"], sample.plan_file["predicted"]["epochs_factor"]) == (
        "sample",
        "sample",
        1.5,
    )
    flush = planned(schedule="flush")
    assert (flush.stale_rate, flush.plan_file["stale_rate"]) == (None, None)
    plain = planned(schedule="pipedream", stale_correction=False)
    assert (plain.stale_rate, plain.plan_file["stale_rate"]) == (None, None)
    # --stragglers runs a layout whose first stage alone is replicated as flexible data parallelism: nothing stale
    flexible = planned(schedule="pipedream", replicas="2-1-1", stragglers="slack")
    assert (flexible.stale_rate, flexible.plan_file["stale_rate"]) == (None, None)


def test_a_plan_file_runs_at_the_stale_rate_it_was_planned_with(tmp_path: Path) -> None:
    """``--plan FILE`` with ``--stale-rate auto`` keeps the file's rate, whatever the table says now; a rate asked
    for replaces it, and a file without one (an older one) gets the table's."""
    names = [str(i) for i in range(6)]
    cfg = TrainConfig.from_options(workers=4, schedule="pipedream", stages=4)
    layout = choose_layout(cfg, names=names, costs=_costs(), batches=20, samples=1280, layout=fixed_layout(cfg, 6, 4))
    assert layout.stale_rate == "sample"  # the shipped table has nothing for "toy"
    for written, asked, runs in [
        ("damped", "auto", "damped"),
        ("damped", "sample", "sample"),
        (None, "auto", "sample"),
    ]:
        plan = {**layout.plan_file, "stale_rate": written}
        (tmp_path / "plan.json").write_text(json.dumps(plan))
        again = TrainConfig.from_options(workers=4, plan=str(tmp_path / "plan.json"), stale_rate=asked)
        fixed = fixed_layout(again, 6, 4)
        assert fixed is not None and fixed.stale_rate == written
        chosen = choose_layout(again, names=names, costs=_costs(), batches=20, samples=1280, layout=fixed)
        assert (chosen.stale_rate, chosen.plan_file["stale_rate"]) == (runs, runs), (written, asked)
    (tmp_path / "plan.json").write_text(json.dumps({**layout.plan_file, "stale_rate": "fast"}))
    with pytest.raises(ValueError, match="stale_rate is 'fast'; give sample, damped or null"):
        fixed_layout(TrainConfig.from_options(workers=4, plan=str(tmp_path / "plan.json")), 6, 4)


def test_one_worker_alone_is_simulated_at_the_batch_it_measured_whatever_an_update_costs() -> None:
    layers = tuple(replace(lay, step_s=1e-3 * (i + 1)) for i, lay in enumerate(_costs().profile.layers))
    costs = replace(
        _costs(workers=1, network=None),
        profile=replace(_costs().profile, layers=layers),
        link=None,
        allreduce=None,
        alone_batch_s=0.25,
        update_factors=(2.5, 4.0),
    )
    alone = costs.alone(batch=32, microbatches=2)
    assert alone is not None
    plan = Plan((PlannedStage(0, len(layers) - 1, 1, 0.0),), 0.0, 0.0, 0.0, "flush", 2)
    batches = 3
    seconds = predict(plan, alone, costs.topology, minibatches=2 * batches, runtime=costs.runtime).seconds
    assert seconds / batches == pytest.approx(0.25)  # the update's factor included, nothing counted twice


@pytest.mark.parametrize(
    ("balance", "replicas", "cores", "warned"),
    [([3, 3], [2, 2], 2, True), ([6], [4], 2, True), ([3, 3], [1, 1], 2, False), ([3, 3], [2, 2], None, False)],
)
def test_a_layout_on_more_workers_than_cores_says_its_prediction_is_optimistic(
    balance: list[int], replicas: list[int], cores: int | None, warned: bool
) -> None:
    layout = Layout(
        schedule="pipedream",
        balance=balance,
        replicas=replicas,
        microbatches=4,
        plan_file={"measured_at_start": {"workers": sum(replicas), "cores": cores}},
    )
    assert ("4 workers share 2 cores: a message or an all-reduce then wakes" in layout.describe()) == warned


@pytest.mark.slow
def test_kept_figures_a_run_lands_far_from_are_removed_and_measured_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Figures kept in a slow hour would be planned from forever: a run that measures its steady rate further
    from their prediction than 15% (or their spread) removes them, says so, and the next run measures afresh."""
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path / "data"))

    def run(name: str) -> RunSummary:
        summary = train(TrainConfig.from_options(model="mlp", workers=1, epochs=2, run_dir=str(tmp_path / name)))
        assert summary is not None
        return summary

    first = run("a")
    assert first.prediction.measured_at_start["kept_at"] is None and not first.kept_figures_missed()
    (kept,) = (tmp_path / "data" / "cache" / "costs").iterdir()
    figures = json.loads(kept.read_text())
    figures["single_worker_samples_per_s"] /= 10  # a tenth of the rate the run will measure
    figures["alone_batch_s"] *= 10
    for layer in figures["profile"]["layers"]:
        for time_s in ("forward_s", "backward_s", "step_s"):
            layer[time_s] *= 10
    kept.write_text(json.dumps(figures))
    slow = run("b")
    assert slow.prediction.measured_at_start["kept_at"] == str(kept) and slow.prediction.error > 2
    assert slow.kept_figures_missed() and not kept.exists()
    assert any("they are removed and the next run measures afresh" in note for note in slow.notes())
    again = run("c")
    assert again.prediction.measured_at_start["source"] == "measured at start-up" and kept.exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_layout_of_two_workers_that_misses_keeps_its_measured_ratio_with_the_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pipeline that runs far under what an earlier run said: the figures stay, and the layout's ratio to its
    simulation becomes what this run measured."""
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path / "data"))

    def run(name: str) -> RunSummary:
        options = {"model": "mlp", "workers": 2, "stages": 2, "epochs": 3, "run_dir": str(tmp_path / name)}
        summary = train(TrainConfig.from_options(**options))
        assert summary is not None
        return summary

    first = run("a")
    (kept,) = (tmp_path / "data" / "cache" / "costs").iterdir()
    figures = json.loads(kept.read_text())
    missed = first.layout_missed()
    (trial,) = first.layout["plan_file"]["trials"]  # tried before training: its ratio kept, unless the run missed
    kept_ratio = trial["measured_over_simulated"] if missed is None else missed
    assert figures["layout_ratios"] == {first.layout_key(): kept_ratio}
    figures["layout_ratios"] = {first.layout_key(): 1000.0}  # as if a run had measured 1,000 times its simulation
    figures["spread"] = 0.0  # measured on busy cores the spread can pass 100%, and misses within it are trusted
    kept.write_text(json.dumps(figures))
    fast = run("b")
    assert fast.layout["plan_file"]["predicted"]["measured_over_simulated"] == 1000 and fast.prediction.error < -0.9
    assert fast.layout_missed() == 500.0  # at most halved by one run
    assert kept.exists() and json.loads(kept.read_text())["layout_ratios"] == {first.layout_key(): fast.layout_missed()}
    assert any("predicts this layout at" in note for note in fast.notes())
