"""The model store: register, list, show, remove; concurrent registrations; the command line; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conveyor.cli import main
from conveyor.processes import worker_context  # forked from a server that imported torch: no import each
from conveyor.warmstart._store import ModelStore, default_model_store

GRAPH = {
    "nodes": [
        {"name": "0", "op": "Linear", "params": {"weight": [16, 64], "bias": [16]}, "inputs": []},
        {"name": "1", "op": "ReLU", "params": {}, "inputs": [0]},
    ]
}


def _checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"0.weight": torch.ones(16, 64)}}, folder / "ckpt.pt")
    return folder / "ckpt.pt"


def test_register_list_get_remove(tmp_path: Path) -> None:
    store = ModelStore(tmp_path / "models")
    assert store.list() == []
    a = store.register(_checkpoint(tmp_path), "mlp", 0.9, GRAPH, {"width": 16})
    b = store.register(_checkpoint(tmp_path), "mlp", 0.95, GRAPH, {"width": 16})  # same second and process
    assert a.id != b.id and [e.id for e in store.list()] == [a.id, b.id]
    assert store.get(a.id).info == {"width": 16} and store.get(a.id).parameters() == 16 * 64 + 16
    assert torch.load(store.checkpoint(b.id))["model"]["0.weight"].sum() == 16 * 64
    store.remove(a.id)
    assert [e.id for e in store.list()] == [b.id]
    with pytest.raises(ValueError, match=r"no model 'nope' in .*: `conveyor models list` shows the stored ones"):
        store.get("nope")
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        store.register(tmp_path / "missing.pt", "mlp", 0.9, GRAPH)
    with pytest.raises(ValueError, match=r"accuracy must be in \[0, 1\]"):
        store.register(_checkpoint(tmp_path), "mlp", 90.0, GRAPH)


def test_default_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVEYOR_DATA", str(tmp_path))
    assert default_model_store() == tmp_path / "models"


def _register(root: str, checkpoint: str, n: int) -> None:
    store = ModelStore(root)
    for i in range(n):
        store.register(checkpoint, "mlp", 0.5 + i / 100, GRAPH)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_registrations_lose_nothing(tmp_path: Path) -> None:
    checkpoint = _checkpoint(tmp_path)
    ctx = worker_context()
    procs = [ctx.Process(target=_register, args=(str(tmp_path / "models"), str(checkpoint), 5)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(100)
    assert all(p.exitcode == 0 for p in procs)
    entries = ModelStore(tmp_path / "models").list()
    assert len(entries) == 15 and len({e.id for e in entries}) == 15
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")]  # no staging left


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = ModelStore(tmp_path / "models")
    entry = store.register(_checkpoint(tmp_path), "mlp", 0.9, GRAPH)
    root = ["--store", str(store.root)]
    assert main(["models", "list", *root]) == 0
    assert "1 models in" in capsys.readouterr().out
    assert main(["models", "show", entry.id, *root]) == 0
    assert '"parameters": 1040' in capsys.readouterr().out
    assert main(["models", "remove", entry.id, *root]) == 0 and store.list() == []
    assert main(["models", "show", entry.id, *root]) == 2
    assert f"no model '{entry.id}'" in capsys.readouterr().err
