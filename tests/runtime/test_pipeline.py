"""Pipelines on real processes match a single-process run on the whole batch, whatever the layout and counts."""

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MODELS, batches

from conveyor.runtime import Pipeline, WorkerError, launch
from conveyor.schedule import flush

pytestmark = pytest.mark.timeout(180)

MICROBATCHES = 4
SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 8, 7 and 3 samples: uneven microbatches, and an empty one in the last batch."""
    return [(x[:n], y[:n]) for (x, y), n in zip(batches(), (8, 7, 3), strict=True)]


def _reference(model_name: str) -> dict[str, Any]:
    """Gradients after one batch, then losses and weights after every batch: one step on each whole batch."""
    model = MODELS[model_name][0]()
    opt = SGD(model.parameters())
    grads, losses = None, []
    for x, y in _data():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss.item())
        opt.step()
    with torch.no_grad():
        evals = model(_data()[1][0])
    return {"grads": grads, "losses": losses, "params": model.state_dict(), "eval": evals}


def _pipelined(replicas: list[int]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for model_name, (factory, balances) in MODELS.items():
        balance = balances[len(replicas)]
        for schedule in ("gpipe", "flush"):
            first = _data()[0]
            layout = {"schedule": schedule, "replicas": replicas}
            grad_pipe = Pipeline(factory(), balance, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, **layout)
            grad_pipe.train_step(*first)
            grads = {n: p.grad.clone() for n, p in grad_pipe.module.named_parameters()}
            pipe = Pipeline(
                factory(), balance, microbatches=MICROBATCHES, loss_fn=F.cross_entropy, optimizer=SGD, **layout
            )
            losses = [pipe.train_step(x, y) for x, y in _data()]
            out[(model_name, schedule)] = {
                "grads": grads,
                "losses": losses,
                "params": {k: v.clone() for k, v in pipe.module.state_dict().items()},
                "eval": pipe.evaluate(_data()[1][0]),
                "peak_stashed": pipe.peak_stashed,
            }
    return out


def _merge(per_rank: dict[int, dict], key: tuple[str, str], field: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in per_rank.values():
        merged.update(result[key][field])
    return merged


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [[1, 1], [1, 1, 1, 1], [3, 1], [1, 2]])
def test_pipelines_match_one_step_on_the_whole_batch(replicas: list[int]) -> None:
    """GPipe and PipeDream-Flush equal gradient accumulation over each batch however it is split: uneven
    microbatches, an empty one, replica counts that divide nothing; every replica ends with the same weights."""
    workers = sum(replicas)
    per_rank = launch(_pipelined, replicas, nprocs=workers, timeout_s=150)
    output = per_rank[workers - replicas[-1]]
    for model_name in MODELS:
        ref = _reference(model_name)
        for schedule in ("gpipe", "flush"):
            key = (model_name, schedule)
            for rank, result in per_rank.items():
                for field in ("grads", "params"):
                    for name, value in result[key][field].items():
                        torch.testing.assert_close(
                            value, ref[field][name], rtol=1e-5, atol=1e-6, msg=f"{key} rank {rank} {field} {name}"
                        )
            assert _merge(per_rank, key, "params").keys() == ref["params"].keys()
            assert output[key]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
            torch.testing.assert_close(output[key]["eval"], ref["eval"], rtol=1e-5, atol=1e-6)
            others = [r for r in range(workers) if r != workers - replicas[-1]]
            assert all(per_rank[r][key]["losses"] == [None] * 3 and per_rank[r][key]["eval"] is None for r in others)
            if replicas == [1] * len(replicas):
                stages = len(replicas)
                peaks = [per_rank[r][key]["peak_stashed"] for r in range(stages)]
                expected = [MICROBATCHES] * stages if schedule == "gpipe" else [stages - r for r in range(stages)]
                assert peaks == expected, (key, peaks)


def _bad_inputs() -> dict[str, str]:
    from models import mlp

    errors = {}
    try:
        Pipeline(mlp(), [2, 2, 1], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    except RuntimeError as exc:
        errors["world"] = str(exc)
    pipe = Pipeline(mlp(), [3, 2], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    x = batches()[0][0]
    for name, bad in (("missing", [(None, None)]), ("pair", [x])):
        try:
            pipe.train(bad)
        except ValueError as exc:
            errors[name] = str(exc)
        dist.barrier()
    return errors


@pytest.mark.slow
def test_bad_inputs_get_errors_that_name_the_fix() -> None:
    per_rank = launch(_bad_inputs, nprocs=2, timeout_s=60)
    assert "3 stages with replicas 1-1-1, which need 3 workers, but 2 were started: start 3" in per_rank[0]["world"]
    assert "worker 0 needs the batches' inputs: pass them on this worker" in per_rank[0]["missing"]
    assert "worker 1 needs the batches' targets: pass them on this worker" in per_rank[1]["missing"]
    assert "a batch must be an (inputs, targets) pair, got Tensor" in per_rank[1]["pair"]


def _mismatched() -> None:
    from models import mlp

    pipe = Pipeline(mlp(), [3, 2], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    x, y = batches()[0]
    pipe.train([(x, y[:6] if pipe.is_last else y)])


@pytest.mark.slow
def test_inputs_and_targets_of_different_batches_stop_the_job() -> None:
    with pytest.raises(WorkerError, match="microbatch 2 has 2 samples of inputs but 1 targets: give every worker"):
        launch(_mismatched, nprocs=2, timeout_s=60)


def _traced() -> list[str]:
    from models import mlp

    pipe = Pipeline(mlp(), [3, 2], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    pipe.executor.trace = []
    pipe.train_step(*batches()[0])
    return [str(a) for a, start, end in pipe.executor.trace if start <= end]


@pytest.mark.slow
def test_the_executor_runs_exactly_the_schedule() -> None:
    per_rank = launch(_traced, nprocs=2, timeout_s=60)
    assert per_rank[0] == [str(a) for a in flush(2, MICROBATCHES).actions[0]]
    assert per_rank[1] == [str(a) for a in flush(2, MICROBATCHES).actions[1]]


@pytest.mark.slow
def test_a_failing_worker_stops_the_others() -> None:
    with pytest.raises(WorkerError, match="needs the batches' targets"):
        launch(_one_side_missing, nprocs=2, timeout_s=60)


def _one_side_missing() -> None:
    from models import mlp

    pipe = Pipeline(mlp(), [3, 2], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
    pipe.train([(batches()[0][0], None)])


def test_pipeline_needs_torch_distributed() -> None:
    from models import mlp

    with pytest.raises(RuntimeError, match=r"conveyor\.launch"):
        Pipeline(mlp(), [5], microbatches=MICROBATCHES, loss_fn=F.cross_entropy)
