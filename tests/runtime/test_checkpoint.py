"""Checkpoints: original names, any stage count, plain modules, atomic writes, clear errors."""

from functools import partial
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from models import batches, branchy, mlp

import conveyor.runtime._checkpoint as checkpoint
from conveyor.runtime._checkpoint import CheckpointError
from conveyor.runtime._launch import launch
from conveyor.runtime._pipeline import Pipeline

ADAM = partial(torch.optim.Adam, lr=0.01)


def _train_and_save(path: str, balance: list[int], steps: int) -> None:
    pipe = Pipeline(mlp(), balance, microbatches=4, loss_fn=F.cross_entropy, optimizer=ADAM)
    for x, y in batches(steps):
        pipe.train_step(x, y)
    pipe.save(path)


def _resume_and_train(path: str, balance: list[int]) -> dict[str, torch.Tensor]:
    pipe = Pipeline(mlp(), balance, microbatches=4, loss_fn=F.cross_entropy, optimizer=ADAM)
    pipe.load(path)
    assert pipe.steps == 2
    x, y = batches(3)[2]
    pipe.train_step(x, y)
    return {k: v.clone() for k, v in pipe.module.state_dict().items()}


def _load_wrong_model(path: str) -> str:
    pipe = Pipeline(branchy(), [2, 2], microbatches=4, loss_fn=F.cross_entropy)
    try:
        pipe.load(path)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_save_on_4_stages_resume_on_2_and_in_a_plain_module(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt" / "model.pt")
    launch(_train_and_save, path, [1, 1, 2, 1], 2, nprocs=4, timeout_s=90)

    # The file holds the plain model's state dict: it loads as is into an nn.Module.
    plain = mlp()
    plain.load_state_dict(checkpoint.load(path)["model"])

    # Reference: the same three steps (two before the save, one after) uninterrupted on one process.
    ref = mlp()
    opt = ADAM(ref.parameters())
    for x, y in batches(3):
        opt.zero_grad()
        for xm, ym in zip(x.chunk(4), y.chunk(4), strict=True):
            (F.cross_entropy(ref(xm), ym) / 4).backward()
        opt.step()

    resumed = launch(_resume_and_train, path, [3, 2], nprocs=2, timeout_s=90)
    merged = {k: v for part in resumed.values() for k, v in part.items()}
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(merged[name], p, rtol=1e-5, atol=1e-6, msg=name)

    wrong = launch(_load_wrong_model, path, nprocs=2, timeout_s=60)
    assert "is from another model" in wrong[0] and "missing" in wrong[0] and "unexpected" in wrong[0]


def test_round_trip_keeps_every_entry(tmp_path: Path) -> None:
    state = mlp().state_dict()
    path = checkpoint.save(tmp_path / "a.pt", state, steps=7)
    payload = checkpoint.load(path)
    assert payload["steps"] == 7
    assert payload["model"].keys() == state.keys()
    assert all(torch.equal(payload["model"][k], v) for k, v in state.items())


def test_crash_mid_save_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "model.pt"
    checkpoint.save(path, {"w": torch.zeros(3)})

    def torn_write(obj: object, fh: object) -> None:
        fh.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn_write)
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(path, {"w": torch.ones(3)})
    assert torch.equal(checkpoint.load(path)["model"]["w"], torch.zeros(3))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left behind


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no checkpoint at .*nope.pt: check the path"):
        checkpoint.load(tmp_path / "nope.pt")


def test_garbage_file_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable checkpoint"):
        checkpoint.load(bad)


def test_foreign_torch_file_is_reported(tmp_path: Path) -> None:
    other = tmp_path / "other.pt"
    torch.save({"weight": torch.zeros(1)}, other)
    with pytest.raises(CheckpointError, match="not a Conveyor checkpoint"):
        checkpoint.load(other)


def test_saving_onto_a_directory_is_reported(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a directory"):
        checkpoint.save(tmp_path, {})


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(CheckpointError, match=r"1 of other shape \(e.g. w: \(2,\) vs \(3,\)\)"):
        checkpoint.check_compatible({"w": torch.zeros(2)}, {"w": torch.Size([3])}, "ckpt")


def test_optimizer_state_moves_between_splits() -> None:
    a, b = mlp(), mlp()
    opt_a = torch.optim.Adam(a.parameters(), lr=0.5)
    a(torch.randn(2, 8)).sum().backward()
    opt_a.step()
    named = checkpoint.named_optimizer_state(opt_a, a)
    assert set(named["state"]) == {n for n, _ in a.named_parameters()}
    opt_b = torch.optim.Adam(b.parameters(), lr=0.1)
    checkpoint.set_optimizer_state(opt_b, b, named)
    assert opt_b.param_groups[0]["lr"] == 0.5
    for (n, p_a), p_b in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(opt_b.state[p_b]["exp_avg"], opt_a.state[p_a]["exp_avg"], msg=n)


def test_a_mapped_read_gives_the_same_checkpoint_and_refuses_the_same_files(tmp_path: Path) -> None:
    """``mapped=True`` (the launcher reads a checkpoint's shapes and its run's epochs so) holds what a plain read
    does; a file that is no checkpoint is refused with the same message."""
    path = checkpoint.save(tmp_path / "c.pt", {"w": torch.arange(6.0).view(2, 3)}, history=[{"epoch": 1}], steps=4)
    plain, mapped = checkpoint.load(path), checkpoint.load(path, mapped=True)
    assert mapped["history"] == plain["history"] == [{"epoch": 1}] and mapped["steps"] == 4
    assert torch.equal(mapped["model"]["w"], plain["model"]["w"])
    (tmp_path / "bytes").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(CheckpointError, match=r"is not a readable checkpoint \(UnpicklingError\)"):
        checkpoint.load(tmp_path / "bytes", mapped=True)
