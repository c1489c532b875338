"""Sites joined by a WAN take the updates of their equations (conveyor.gaia's docstrings), computed here in one
process: Gaia with a threshold of 0 and DiLoCo with one local step and a plain outer SGD of rate 1 are
synchronous data parallelism; otherwise each site's weights follow the filter's or the rounds' equations."""

import time
from functools import partial
from types import MethodType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import batches, mlp

from conveyor.gaia import DiLoCo, Gaia
from conveyor.runtime import Pipeline, launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

LR, MOMENTUM = 0.05, 0.9
STEPS, SIZE = 7, 24


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _set_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    with torch.no_grad():
        for p, part in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()]), strict=True):
            p.copy_(part.view_as(p))


def _grad(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, over: int) -> torch.Tensor:
    """The sum over the rows of each sample's loss gradient, over ``over``."""
    loss = F.cross_entropy(model(x), y, reduction="sum") / over
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(model.parameters()))])


def _site_rows(x: torch.Tensor, workers: int, sites: int, site: int) -> torch.Tensor:
    """The rows of the microbatches site ``site``'s replicas run (one microbatch per worker, in rank order)."""
    per_site = workers // sites
    return torch.cat(x.tensor_split(workers)[site * per_site : (site + 1) * per_site])


def _sites(sites: int, momentum: float) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = []
    for _ in range(sites):
        model = mlp()
        out.append((model, torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)))
    return out


def gaia_reference(
    workers: int, sites: int, threshold: float, period: int = 1, estimate: bool = False
) -> list[torch.Tensor]:
    """Each site's weights after ``STEPS`` updates of Gaia's equations, an exchange every ``period`` updates,
    each read at once, the values sent in bfloat16 (the rest kept pending); with ``estimate``, each site's own share
    standing in for what the others hold back."""
    models = _sites(sites, MOMENTUM)
    n = _flat(models[0][0]).numel()
    pending = [torch.zeros(n) for _ in range(sites)]
    own = [torch.zeros(n) for _ in range(sites)]  # S_d
    at = [[torch.zeros(n) for _ in range(sites)] for _ in range(sites)]  # B_d,e
    for t, (x, y) in enumerate(batches(n=STEPS, size=SIZE), start=1):
        shares, sent, masks = [], [], []
        for d, (model, _) in enumerate(models):
            g = _grad(model, _site_rows(x, workers, sites, d), _site_rows(y, workers, sites, d), SIZE)
            shares.append(g)
            pending[d] += g
            chosen = LR * pending[d].abs() > threshold * _flat(model).abs()
            if t % period:
                chosen = torch.zeros(n, dtype=torch.bool)  # not an exchange: nothing is tested or sent
            sent.append(torch.where(chosen, pending[d].bfloat16().float(), torch.zeros(n)))
            masks.append(chosen)
            pending[d] -= sent[d]
            own[d] += g
        for d, (model, opt) in enumerate(models):
            step = shares[d] + sum(s for e, s in enumerate(sent) if e != d)
            if estimate:
                step = sites * shares[d]
                for e in (e for e in range(sites) if e != d):
                    step = step + torch.where(masks[e], sent[e] - (own[d] - at[d][e]), 0.0)
                    at[d][e] = torch.where(masks[e], own[d], at[d][e])
            for p, part in zip(model.parameters(), step.split([p.numel() for p in model.parameters()]), strict=True):
                p.grad = part.view_as(p).clone()
            opt.step()
    return [_flat(model) for model, _ in models]


def diloco_reference(
    workers: int, sites: int, local_steps: int, outer_lr: float, outer_momentum: float, momentum: float
) -> list[torch.Tensor]:
    """Each site's weights after ``STEPS`` updates of DiLoCo's equations."""
    models = _sites(sites, momentum)
    anchor = _flat(models[0][0])
    outer = torch.optim.SGD([anchor], lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0)
    for t, (x, y) in enumerate(batches(n=STEPS, size=SIZE), start=1):
        for d, (model, opt) in enumerate(models):
            xs, ys = _site_rows(x, workers, sites, d), _site_rows(y, workers, sites, d)
            g = _grad(model, xs, ys, len(ys))
            for p, part in zip(model.parameters(), g.split([p.numel() for p in model.parameters()]), strict=True):
                p.grad = part.view_as(p).clone()
            opt.step()
        if t % local_steps == 0:
            anchor.grad = sum(anchor - _flat(model) for model, _ in models) / sites
            outer.step()
            for model, _ in models:
                _set_flat(model, anchor)
    return [_flat(model) for model, _ in models]


def dp_reference() -> torch.Tensor:
    """Synchronous data parallelism: one SGD step per batch on its mean gradient."""
    return diloco_reference(1, 1, 1, 1.0, 0.0, MOMENTUM)[0]  # one site, whose outer step takes its weights


def _train(workers: int, make: Any, momentum: float) -> dict[str, Any]:
    torch.set_num_threads(1)
    outer = make()
    pipe = Pipeline(
        mlp(),
        1,
        microbatches=workers,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=LR, momentum=momentum),
        replicas=[workers],
        outer=outer,
    )
    pipe.train(batches(n=STEPS, size=SIZE))
    return {"weights": _flat(pipe.module), "records": pipe.wan_records()}


@pytest.mark.parametrize(("workers", "sites"), [(4, 2), (3, 3)])
def test_gaia_with_threshold_zero_is_synchronous_data_parallelism(workers: int, sites: int) -> None:
    make = partial(Gaia, sites, threshold=0.0, staleness=1, wire_dtype=torch.float32)  # exact on the wire
    out = launch(_train, workers, make, MOMENTUM, nprocs=workers, timeout_s=150)
    expected = dp_reference()
    for rank, result in out.items():
        torch.testing.assert_close(result["weights"], expected, rtol=1e-5, atol=1e-6, msg=f"worker {rank}")
    records = out[0]["records"]
    assert [r["site"] for r in records] == list(range(sites))
    assert all(r["updates"] == STEPS and r["late_max"] == 0 for r in records)  # every exchange read at once


@pytest.mark.parametrize(("workers", "sites", "threshold"), [(4, 2, 0.02), (3, 3, 0.05)])
def test_gaia_sends_what_its_filter_selects(workers: int, sites: int, threshold: float) -> None:
    make = partial(Gaia, sites, threshold=threshold, staleness=1)
    out = launch(_train, workers, make, MOMENTUM, nprocs=workers, timeout_s=150)
    expected = gaia_reference(workers, sites, threshold)
    assert not torch.allclose(expected[0], expected[1])  # the sites' weights differ by what is pending
    for rank, result in out.items():
        site = rank // (workers // sites)
        torch.testing.assert_close(result["weights"], expected[site], rtol=1e-5, atol=1e-6, msg=f"worker {rank}")
    records = out[0]["records"]
    assert all(0 < r["sent_fraction"] < 1 for r in records)  # some entries held back, some sent
    assert all(r["late_max"] == 0 and r["pending_max"] > 0 for r in records)


def test_gaia_exchanging_every_few_updates_sends_what_built_up_meanwhile() -> None:
    workers, sites, threshold, period = 3, 3, 0.02, 3
    make = partial(Gaia, sites, threshold=threshold, period=period)
    out = launch(_train, workers, make, MOMENTUM, nprocs=workers, timeout_s=150)
    expected = gaia_reference(workers, sites, threshold, period)
    assert not torch.allclose(expected[0], gaia_reference(workers, sites, threshold)[0])  # the period matters
    for rank, result in out.items():
        torch.testing.assert_close(result["weights"], expected[rank], rtol=1e-5, atol=1e-6, msg=f"worker {rank}")
    records = out[0]["records"]
    assert all(r["updates"] == STEPS and r["entries_sent"] > 0 and r["late_max"] == 0 for r in records)
    assert all(r["pending_max"] >= period - 1 for r in records)  # an update waits for the next exchange


def test_with_the_estimate_a_site_stands_its_own_share_in_for_what_the_others_hold_back() -> None:
    workers, sites, threshold, period = 3, 3, 0.05, 2
    make = partial(Gaia, sites, threshold=threshold, period=period, estimate=True)
    out = launch(_train, workers, make, MOMENTUM, nprocs=workers, timeout_s=150)
    expected = gaia_reference(workers, sites, threshold, period, estimate=True)
    assert not torch.allclose(expected[0], gaia_reference(workers, sites, threshold, period)[0])  # it matters
    for rank, result in out.items():
        torch.testing.assert_close(result["weights"], expected[rank], rtol=1e-5, atol=1e-6, msg=f"worker {rank}")


def _slow_leader(rank: int) -> Any:
    """A Gaia whose leader of site 1 (worker ``rank``) posts late: its exchanges lag the others' updates."""
    gaia = Gaia(2, threshold=0.02, staleness=3)
    if torch.distributed.get_rank() == rank:
        post = Gaia._significant

        def slow(self: Gaia, *args: Any) -> Any:
            time.sleep(0.05)
            return post(self, *args)

        gaia._significant = MethodType(slow, gaia)  # type: ignore[method-assign]
    return gaia


def test_the_mirror_clock_bounds_how_late_an_update_is_read() -> None:
    out = launch(_train, 4, partial(_slow_leader, 2), MOMENTUM, nprocs=4, timeout_s=150)
    for a, b in ((0, 1), (2, 3)):  # a site's replicas take the same updates at the same steps
        torch.testing.assert_close(out[a]["weights"], out[b]["weights"], rtol=0, atol=0)
    assert not torch.allclose(out[0]["weights"], out[2]["weights"])
    records = out[0]["records"]
    assert all(r["updates"] == STEPS and r["entries_sent"] > 0 for r in records)
    assert max(r["late_max"] for r in records) <= 2  # staleness 3: read at most 2 updates after its post
    assert records[0]["late_max"] >= 1  # site 0 went on while site 1's late posts were in flight


@pytest.mark.parametrize(("workers", "sites"), [(4, 2), (3, 3)])
def test_diloco_with_one_local_step_and_outer_sgd_of_rate_one_is_synchronous(workers: int, sites: int) -> None:
    make = partial(DiLoCo, sites, local_steps=1, outer_lr=1.0, outer_momentum=0.0)
    out = launch(_train, workers, make, 0.0, nprocs=workers, timeout_s=150)
    expected = diloco_reference(1, 1, 1, 1.0, 0.0, 0.0)[0]  # plain SGD on each batch's mean gradient
    for rank, result in out.items():
        torch.testing.assert_close(result["weights"], expected, rtol=1e-5, atol=1e-6, msg=f"worker {rank}")


def test_diloco_takes_local_steps_then_an_outer_nesterov_step() -> None:
    make = partial(DiLoCo, 2, local_steps=3, outer_lr=0.7, outer_momentum=0.9)
    out = launch(_train, 4, make, MOMENTUM, nprocs=4, timeout_s=150)
    expected = diloco_reference(4, 2, 3, 0.7, 0.9, MOMENTUM)
    assert not torch.allclose(expected[0], expected[1])  # 7 updates: one local step since the last round
    for rank, result in out.items():
        torch.testing.assert_close(result["weights"], expected[rank // 2], rtol=1e-5, atol=1e-6, msg=f"worker {rank}")
    assert [r["rounds"] for r in out[0]["records"]] == [2, 2]


def _train_pipeline(balance: list[int], replicas: list[int], sites: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipe = Pipeline(
        mlp(),
        balance,
        microbatches=3,
        loss_fn=F.cross_entropy,
        optimizer=partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM),
        replicas=replicas,
        outer=Gaia(sites, threshold=0.0, staleness=1, wire_dtype=torch.float32),
    )
    pipe.train(batches(n=STEPS, size=SIZE) if pipe.is_first or pipe.is_last else None)
    return {"params": {k: v.detach().clone() for k, v in pipe.module.named_parameters()}, "stage": pipe.stage}


@pytest.mark.parametrize(("balance", "replicas", "sites"), [([3, 2], [3, 1], 2), ([3, 2], [3, 3], 3)])
def test_replicated_stages_across_data_centres_take_the_whole_batch_step(
    balance: list[int], replicas: list[int], sites: int
) -> None:
    # Data centres of 2 workers: a replicated stage spans two (3 replicas: 2 + 1, or 1 + 2 from the second data
    # centre on); with a threshold of 0 and float32 on the wire the pipeline takes the unsplit model's step on
    # each batch.
    out = launch(_train_pipeline, balance, replicas, sites, nprocs=sum(replicas), timeout_s=150)
    model = mlp()
    _set_flat(model, dp_reference())
    expected = dict(model.named_parameters())
    for rank, result in out.items():
        assert result["params"], f"worker {rank} holds no parameters"
        for name, p in result["params"].items():
            torch.testing.assert_close(p, expected[name].detach(), rtol=1e-5, atol=1e-6, msg=f"worker {rank} {name}")


def _save_and_resume(make: Any, path: str) -> dict[str, Any]:
    """Train, save, and load the checkpoint into a new pipeline: each site's outer state before and after."""
    torch.set_num_threads(1)

    def pipeline() -> Pipeline:
        return Pipeline(
            mlp(),
            1,
            microbatches=4,
            loss_fn=F.cross_entropy,
            optimizer=partial(torch.optim.SGD, lr=LR, momentum=MOMENTUM),
            replicas=[4],
            outer=make(),
        )

    first = pipeline()
    first.train(batches(n=STEPS, size=SIZE))
    first.save(path)
    again = pipeline()
    again.load(path)
    assert first.outer is not None and again.outer is not None
    return {"saved": first.outer.state_dict(), "loaded": again.outer.state_dict()}


@pytest.mark.parametrize(
    "make",
    [partial(Gaia, 2, threshold=0.5, staleness=1, period=2, estimate=True), partial(DiLoCo, 2, local_steps=3)],
    ids=["gaia", "diloco"],
)
def test_a_checkpoint_keeps_each_data_centres_outer_state(make: Any, tmp_path) -> None:
    out = launch(_save_and_resume, make, str(tmp_path / "model.pt"), nprocs=4, timeout_s=150)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "model.pt.stage0.site0", "model.pt.stage0.site1"]
    for rank in (0, 2):  # the sites' leaders: what each site had still to send, or its round's anchor and momentum
        saved, loaded = out[rank]["saved"], out[rank]["loaded"]
        assert saved and saved.keys() == loaded.keys()
        assert any(v.abs().sum() > 0 for v in saved.values())
        for key in saved:
            torch.testing.assert_close(loaded[key], saved[key], rtol=0, atol=0, msg=f"worker {rank} {key}")
    if "pending" in out[0]["saved"]:  # gaia's is each site's own (diloco's anchor is every site's)
        assert not torch.equal(out[0]["saved"]["pending"], out[2]["saved"]["pending"])
        # a resumed run exchanges at the same updates on every replica (7 updates: mid-period at a period of 2)
        assert all(int(out[rank]["loaded"]["update"]) == STEPS for rank in range(4))
