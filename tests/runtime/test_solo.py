"""One worker alone trains in a plain loop (``conveyor.runtime._solo``) and makes exactly the executor's updates."""

from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import MODELS, batches

from conveyor.runtime import Pipeline, launch

pytestmark = pytest.mark.timeout(180)

SGD = partial(torch.optim.SGD, lr=0.1, momentum=0.9)
OPTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "clipped": {"max_grad_norm": 0.05},
    "recomputed": {"recompute": True},
    "bf16": {"autocast": torch.bfloat16},
}


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of 8, 7 and 3 samples: uneven microbatches, and empty ones in the last batch of 4."""
    return [(x[:n], y[:n]) for (x, y), n in zip(batches(), (8, 7, 3), strict=True)]


def _trained(factory: Any, schedule: str, microbatches: int, alone: bool, options: dict[str, Any]) -> dict[str, Any]:
    pipe = Pipeline(
        factory(), 1, microbatches=microbatches, loss_fn=F.cross_entropy, optimizer=SGD, schedule=schedule, **options
    )
    took_the_loop = pipe._alone is not None
    if not alone:
        pipe._alone = None  # the executor, on the schedule's action list
    steps: list[int] = []
    losses = pipe.train(_data(), on_step=steps.append)
    return {
        "alone": took_the_loop,
        "losses": losses,
        "params": {k: v.clone() for k, v in pipe.module.state_dict().items()},
        "steps": (steps, pipe.steps),
        "peak_stashed": pipe.peak_stashed,
    }


def _compared() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model_name, (factory, _) in MODELS.items():
        for schedule in ("flush", "gpipe", "pipedream", "pipedream-vs"):
            for microbatches in (1, 4):
                for option, options in OPTIONS.items():
                    key = (model_name, schedule, microbatches, option)
                    out[key] = [_trained(factory, schedule, microbatches, alone, options) for alone in (True, False)]
    stale = Pipeline(MODELS["mlp"][0](), 1, microbatches=4, loss_fn=F.cross_entropy, schedule="2bw")
    out["2bw takes the loop"] = stale._alone is not None
    errors = {}
    pipe = Pipeline(MODELS["mlp"][0](), 1, microbatches=2, loss_fn=F.cross_entropy)
    for name, bad in (
        ("missing", [(None, None)]),
        ("pair", [batches()[0][0]]),
        ("empty", [(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))]),
    ):
        try:
            pipe.train(bad)
        except ValueError as exc:
            errors[name] = str(exc)
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_one_worker_alone_makes_the_executors_updates_bit_for_bit() -> None:
    """flush, gpipe (an update per batch), pipedream and pipedream-vs (per microbatch) on one worker, 1 or 4
    microbatches (uneven, some empty), with clipping, recomputation or bf16 autocast: the plain loop's losses,
    weights (momentum included) and update count equal the executor's exactly. 2BW, which keeps a weight
    version, keeps the executor; a bad batch gets the executor's error."""
    out = launch(_compared, nprocs=1, timeout_s=150)[0]
    assert out.pop("2bw takes the loop") is False
    errors = out.pop("errors")
    assert "worker 0 needs the batches' inputs: pass them on this worker" in errors["missing"]
    assert "a batch must be an (inputs, targets) pair, got Tensor" in errors["pair"]
    assert "batch 0 has no samples: leave empty batches out" in errors["empty"]
    assert len(out) == 3 * 4 * 2 * len(OPTIONS)
    for key, (alone, executor) in out.items():
        assert alone["alone"] and executor["alone"], key  # both pipelines chose the loop; the second was sent back
        assert alone["losses"] == executor["losses"], key
        _, schedule, microbatches, _ = key
        updates = 3 * (1 if schedule in ("flush", "gpipe") else microbatches)  # 3 batches
        assert alone["steps"] == executor["steps"] == (list(range(1, updates + 1)), 3), key
        assert alone["params"].keys() == executor["params"].keys()
        for name, value in alone["params"].items():
            assert torch.equal(value, executor["params"][name]), (key, name)
        assert alone["peak_stashed"] == 1, key
