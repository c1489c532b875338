"""Pipelines on real processes match a single-process run with gradient accumulation."""

from functools import partial
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MODELS, batches

from conveyor.runtime._launch import launch
from conveyor.runtime._pipeline import Pipeline
from conveyor.schedule._schedule import flush

pytestmark = pytest.mark.timeout(180)

MICROBATCHES = 4
SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _reference(model_name: str) -> dict[str, Any]:
    """Gradients after one batch, then losses and weights after every batch, with plain accumulation."""
    model = MODELS[model_name][0]()
    opt = SGD(model.parameters())
    grads, losses, evals = None, [], None
    for x, y in batches():
        opt.zero_grad()
        loss = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True):
            mb_loss = F.cross_entropy(model(xm), ym) / MICROBATCHES
            mb_loss.backward()
            loss += mb_loss.item()
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(loss)
        opt.step()
    with torch.no_grad():
        evals = model(batches()[0][0])
    return {"grads": grads, "losses": losses, "params": model.state_dict(), "eval": evals}


def _pipelined(stages: int) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for model_name, (factory, balances) in MODELS.items():
        for schedule in ("gpipe", "flush"):
            first = batches()[0]
            grad_pipe = Pipeline(factory(), balances[stages], MICROBATCHES, F.cross_entropy, schedule=schedule)
            grad_pipe.train_step(*first)
            grads = {n: p.grad.clone() for n, p in grad_pipe.module.named_parameters()}
            pipe = Pipeline(factory(), balances[stages], MICROBATCHES, F.cross_entropy, SGD, schedule=schedule)
            losses = [pipe.train_step(x, y) for x, y in batches()]
            out[(model_name, schedule)] = {
                "grads": grads,
                "losses": losses,
                "params": {k: v.clone() for k, v in pipe.module.state_dict().items()},
                "eval": pipe.evaluate(first[0]),
                "peak_stashed": pipe.peak_stashed,
            }
    return out


def _merge(per_rank: dict[int, dict], key: tuple[str, str], field: str) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in per_rank.values():
        merged.update(result[key][field])
    return merged


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelines_match_gradient_accumulation(stages: int) -> None:
    per_rank = launch(_pipelined, stages, nprocs=stages, timeout_s=150)
    last = per_rank[stages - 1]
    for model_name in MODELS:
        ref = _reference(model_name)
        for schedule in ("gpipe", "flush"):
            key = (model_name, schedule)
            grads = _merge(per_rank, key, "grads")
            assert grads.keys() == ref["grads"].keys()
            for name, g in ref["grads"].items():
                torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-7, msg=f"{key} grad {name}")
            params = _merge(per_rank, key, "params")
            assert params.keys() == ref["params"].keys()
            for name, p in ref["params"].items():
                torch.testing.assert_close(params[name], p, rtol=1e-6, atol=1e-7, msg=f"{key} param {name}")
            assert last[key]["losses"] == pytest.approx(ref["losses"], rel=1e-6)
            torch.testing.assert_close(last[key]["eval"], ref["eval"], rtol=1e-6, atol=1e-7)
            assert all(per_rank[r][key]["losses"] == [None] * 3 for r in range(stages - 1))
            assert all(per_rank[r][key]["eval"] is None for r in range(stages - 1))
            peaks = [per_rank[r][key]["peak_stashed"] for r in range(stages)]
            expected = [MICROBATCHES] * stages if schedule == "gpipe" else [stages - r for r in range(stages)]
            assert peaks == expected, (key, peaks)


def _bad_inputs() -> dict[str, str]:
    from models import mlp

    errors = {}
    try:
        Pipeline(mlp(), [2, 2, 1], MICROBATCHES, F.cross_entropy)
    except RuntimeError as exc:
        errors["world"] = str(exc)
    pipe = Pipeline(mlp(), [3, 2], MICROBATCHES, F.cross_entropy)
    x, y = batches()[0]
    try:
        pipe.train_step(x[:6], y[:6])
    except ValueError as exc:
        errors["split"] = str(exc)
    try:
        pipe.train_step(None, None)
    except ValueError as exc:
        errors["missing"] = str(exc)
    dist.barrier()
    pipe.executor.trace = []
    pipe.train_step(x, y)
    errors["trace"] = [str(a) for a, start, end in pipe.executor.trace if start <= end]
    return errors


def test_bad_inputs_get_errors_that_name_the_fix() -> None:
    per_rank = launch(_bad_inputs, nprocs=2, timeout_s=60)
    assert "3 stages with replicas 1-1-1, which need 3 workers, but 2 were started: start 3" in per_rank[0]["world"]
    assert "6 samples cannot be split into 4 equal microbatches" in per_rank[0]["split"]
    assert "stage 0 needs the batch's inputs" in per_rank[0]["missing"]
    assert "stage 1 needs the batch's targets" in per_rank[1]["missing"]
    # The executor's trace lists exactly the actions of the worker's schedule, in order.
    assert per_rank[0]["trace"] == [str(a) for a in flush(2, MICROBATCHES).actions[0]]
    assert per_rank[1]["trace"] == [str(a) for a in flush(2, MICROBATCHES).actions[1]]


def test_pipeline_needs_torch_distributed() -> None:
    from models import mlp

    with pytest.raises(RuntimeError, match=r"conveyor\.launch"):
        Pipeline(mlp(), [5], MICROBATCHES, F.cross_entropy)
