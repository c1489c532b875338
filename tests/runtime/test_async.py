"""Asynchronous and replicated pipelines on real processes match single-process references of their semantics."""

from functools import partial
from pathlib import Path
from typing import Any

import pytest
import reference
import torch
import torch.nn.functional as F
from models import batches, mlp, tangle

from conveyor.runtime._launch import WorkerError, launch
from conveyor.runtime._pipeline import Pipeline
from conveyor.runtime._stage import as_blocks, build_stage, stage_ranges
from conveyor.runtime._versions import StashError, WeightVersions

pytestmark = pytest.mark.timeout(240)

N_BATCHES = 4
MICROBATCHES = 6  # enough for 2BW on 4 stages
OPTIMIZERS = {
    "sgd": partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    "adam": partial(torch.optim.Adam, lr=0.01),
}
ASYNC = ("pipedream", "pipedream-vs", "2bw")
BALANCE = {2: [3, 2], 3: [2, 2, 1], 4: [1, 1, 2, 1]}
MODELS = {"mlp": mlp, "tangle": tangle}  # five blocks each: tangle is a module split by torch.export
# (schedule, optimizer, max_grad_norm, autocast)
Case = tuple[str, str, float | None, torch.dtype | None]


# Uneven: batch sizes that no microbatch count divides, the last one shorter than the microbatch count.
UNEVEN = (10, 9, 7, 3)


def _data(sizes: tuple[int, ...] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    full = batches(n=N_BATCHES, size=2 * MICROBATCHES)
    return full if sizes is None else [(x[:n], y[:n]) for (x, y), n in zip(full, sizes, strict=True)]


def _run(
    replicas: tuple[int, ...],
    cases: list[Case],
    m: int = MICROBATCHES,
    sizes: tuple[int, ...] | None = None,
    correct: bool = False,
    model: str = "mlp",
    damped: bool = False,
) -> dict[Case, dict[str, Any]]:
    out = {}
    for case in cases:
        schedule, opt, clip, autocast = case
        pipe = Pipeline(
            MODELS[model](),
            BALANCE[len(replicas)],
            microbatches=m,
            loss_fn=F.cross_entropy,
            optimizer=OPTIMIZERS[opt],
            schedule=schedule,
            replicas=replicas,
            max_grad_norm=clip,
            autocast=autocast,
            correct_staleness=correct,
            damp_stale_rate=damped,
            debug=True,
        )
        losses = pipe.train(_data(sizes))
        out[case] = {
            "params": {k: v.detach().clone() for k, v in pipe.module.named_parameters()},
            "peak_versions": pipe.peak_versions,
            "expected_versions": pipe.schedule(len(_data())).peak_versions()[pipe.worker],
            "losses": losses,
        }
    return out


def _reference(
    replicas: tuple[int, ...],
    case: Case,
    m: int = MICROBATCHES,
    sizes: tuple[int, ...] | None = None,
    correct: bool = False,
    model_name: str = "mlp",
    damped: bool = False,
) -> dict[str, torch.Tensor]:
    schedule, opt, clip, autocast = case
    model = MODELS[model_name]()
    stages = [build_stage(model, r) for r in stage_ranges(BALANCE[len(replicas)], len(as_blocks(model)))]
    reference.train(
        stages, _data(sizes), m, schedule, replicas, OPTIMIZERS[opt], F.cross_entropy, clip, autocast, correct, damped
    )
    return {k: v for st in stages for k, v in st.named_parameters()}


def _check(
    replicas: tuple[int, ...],
    cases: list[Case],
    rtol: float = 1e-5,
    m: int = MICROBATCHES,
    sizes: tuple[int, ...] | None = None,
    correct: bool = False,
    model: str = "mlp",
    damped: bool = False,
) -> dict[Case, dict[str, Any]]:
    per_rank = launch(_run, replicas, cases, m, sizes, correct, model, damped, nprocs=sum(replicas), timeout_s=200)
    for case in cases:
        ref = _reference(replicas, case, m, sizes, correct, model, damped)
        seen = set()
        for rank, result in per_rank.items():
            got = result[case]["params"]
            seen |= got.keys()
            for name, p in got.items():  # every replica holds the same weights
                torch.testing.assert_close(p, ref[name], rtol=rtol, atol=rtol / 10, msg=f"{case} rank {rank} {name}")
            assert result[case]["peak_versions"] == result[case]["expected_versions"], (case, rank)
        assert seen == ref.keys()
    return per_rank


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_async_schedules_match_their_update_equations(stages: int) -> None:
    cases = [(s, opt, None, None) for s in ASYNC for opt in OPTIMIZERS]
    per_rank = _check((1,) * stages, cases)
    peaks = {s: [per_rank[r][(s, "sgd", None, None)]["peak_versions"] for r in range(stages)] for s in ASYNC}
    assert peaks["pipedream"] == [stages - r for r in range(stages)]  # NOAM on the input stage, fewer downstream
    assert peaks["pipedream-vs"] == [stages] * stages
    assert peaks["2bw"] == [2] * stages
    losses = per_rank[stages - 1][("2bw", "sgd", None, None)]["losses"]
    assert len(losses) == 4 and all(isinstance(v, float) for v in losses)


@pytest.mark.slow
def test_clipping_and_autocast() -> None:
    _check((1, 1, 1), [("2bw", "sgd", 0.05, None), ("flush", "sgd", 0.05, None), ("pipedream", "adam", 0.05, None)])
    # Half precision rounds the runtime's loss scaling (before backward) and the reference's gradient mean
    # (after) differently: agreement to 1e-3, while the schedules' semantics differ by more (see below).
    _check((1, 1, 1), [("2bw", "sgd", None, torch.bfloat16), ("2bw", "adam", None, torch.float16)], rtol=1e-2)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [(2, 1), (1, 2), (2, 2), (3, 1)])
def test_replicated_stages_match_their_update_equations(replicas: tuple[int, ...]) -> None:
    opts = ["sgd", "adam"] if replicas == (2, 2) else ["sgd"]
    _check(replicas, [(s, opt, None, None) for s in ("flush", "gpipe", *ASYNC) for opt in opts])


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [(1, 1, 1), (2, 1)])
def test_a_split_model_follows_the_update_equations(replicas: tuple[int, ...]) -> None:
    """A module split by torch.export: its skip crosses every cut, its tied weight goes from the stage that
    holds it to the one that uses it again, stashed version and all; every schedule keeps the equations."""
    _check(replicas, [(s, "sgd", None, None) for s in ("flush", *ASYNC)], model="tangle")


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [(3, 1), (1, 2)])
def test_counts_that_divide_nothing_match_the_update_equations(replicas: tuple[int, ...]) -> None:
    """4 microbatches on 3 replicas, batches of 10, 9, 7 and 3 samples: uneven rounds, a last partial round,
    uneven and empty microbatches; every schedule still follows its equations."""
    _check(replicas, [(s, "sgd", None, None) for s in ("flush", "gpipe", *ASYNC)], m=4, sizes=UNEVEN)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [(1, 1, 1), (2, 1), (1, 2)])
def test_stale_gradient_correction_matches_its_equations(replicas: tuple[int, ...]) -> None:
    """Weight prediction over each stage's staleness, and PipeDream's learning rate per sample, as written in
    the reference; with uneven batches where the layout has replicas."""
    sizes = None if replicas == (1, 1, 1) else UNEVEN
    m = MICROBATCHES if sizes is None else 4
    _check(replicas, [(s, opt, None, None) for s in ASYNC for opt in OPTIMIZERS], m=m, sizes=sizes, correct=True)


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [(1, 1, 1), (2, 1)])
def test_the_damped_rate_matches_its_equations(replicas: tuple[int, ...]) -> None:
    """``--stale-rate damped``: each asynchronous stage's rate also over one plus its staleness."""
    sizes = None if replicas == (1, 1, 1) else UNEVEN
    m = MICROBATCHES if sizes is None else 4
    cases = [(s, "sgd", None, None) for s in ASYNC]
    _check(replicas, cases, m=m, sizes=sizes, correct=True, damped=True)


def test_the_reference_semantics_differ() -> None:
    """The equations give different weights per schedule, and with and without the correction, so matching
    one of them is a real check."""
    case = ("flush", "sgd", None, None)
    base = _reference((1, 1, 1), case)
    for schedule in ASYNC:
        other = _reference((1, 1, 1), (schedule, "sgd", None, None))
        assert max(float((other[k] - base[k]).detach().abs().max()) for k in base) > 1e-3, schedule
        corrected = _reference((1, 1, 1), (schedule, "sgd", None, None), correct=True)
        assert max(float((other[k] - corrected[k]).detach().abs().max()) for k in base) > 1e-3, schedule
        damped = _reference((1, 1, 1), (schedule, "sgd", None, None), correct=True, damped=True)
        assert max(float((damped[k] - corrected[k]).detach().abs().max()) for k in base) > 1e-3, schedule


class _InPlaceVersions(WeightVersions):
    """A broken stash: a step overwrites the newest version's tensors instead of making a new version."""

    def publish(self) -> None:
        if not self.stashing:
            super().publish()
            return
        newest = self._versions[self._newest]
        for name, p in self.module.named_parameters():
            newest[name].data.copy_(p.data)  # .data hides the write from autograd's own check
        self._newest += 1
        self._versions[self._newest] = newest


def _broken() -> None:
    pipe = Pipeline(
        mlp(),
        BALANCE[2],
        microbatches=MICROBATCHES,
        loss_fn=F.cross_entropy,
        optimizer=OPTIMIZERS["sgd"],
        schedule="pipedream",
        debug=True,
    )
    pipe.executor.weights = _InPlaceVersions(pipe.module, debug=True)
    pipe.train(_data())


@pytest.mark.slow
def test_a_broken_stash_is_caught() -> None:
    with pytest.raises(WorkerError) as err:
        launch(_broken, nprocs=2, timeout_s=60)
    assert err.value.error_type == StashError.__name__
    assert "stage 0: the backward of microbatch 1 would use weights other than version 0" in str(err.value)


def _save_after_async(path: str) -> dict[str, Any]:
    x = _data()[0][0]
    pipe = Pipeline(
        mlp(),
        BALANCE[2],
        microbatches=MICROBATCHES,
        loss_fn=F.cross_entropy,
        optimizer=OPTIMIZERS["adam"],
        schedule="pipedream",
        replicas=(2, 1),
    )
    pipe.train(_data())
    pipe.save(path)
    before = pipe.evaluate(x)
    pipe.load(path)
    return {"eval": before, "eval_after_load": pipe.evaluate(x), "output": pipe.is_output}


@pytest.mark.slow
def test_evaluate_and_checkpoint_after_an_asynchronous_run(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    per_rank = launch(_save_after_async, str(path), nprocs=3, timeout_s=60)
    assert [per_rank[r]["output"] for r in range(3)] == [False, False, True]
    assert per_rank[0]["eval"] is None and per_rank[1]["eval"] is None
    model = mlp()
    model.load_state_dict(torch.load(path, weights_only=False)["model"])
    with torch.no_grad():
        expected = model(_data()[0][0])
    torch.testing.assert_close(per_rank[2]["eval"], expected)
    torch.testing.assert_close(per_rank[2]["eval_after_load"], expected)


def _recompute_run(schedule: str) -> dict[bool, dict[str, torch.Tensor]]:
    out = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*mlp(), torch.nn.Dropout(0.3), torch.nn.Linear(4, 4))
        pipe = Pipeline(
            model,
            [3, 4],
            microbatches=MICROBATCHES,
            loss_fn=F.cross_entropy,
            optimizer=OPTIMIZERS["sgd"],
            schedule=schedule,
            recompute=recompute,
        )
        torch.manual_seed(1 + pipe.worker)  # the same dropout masks in both runs
        pipe.train(_data())
        out[recompute] = {k: v.detach().clone() for k, v in pipe.module.named_parameters()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_recomputation_changes_no_weight(schedule: str) -> None:
    """Re-running each forward in the backward (dropout's masks replayed) gives the same training."""
    for result in launch(_recompute_run, schedule, nprocs=2, timeout_s=200).values():
        for name, p in result[False].items():
            torch.testing.assert_close(result[True][name], p, rtol=1e-6, atol=1e-7, msg=name)
