"""The model store: trained models (checkpoint, architecture, accuracy) in a folder that concurrent jobs share.

Each model is a folder ``<store>/<id>/`` holding ``model.pt`` (the checkpoint) and ``entry.json`` (what it
is: its architecture as an operator graph, its accuracy, how it was trained). A model is written into a
temporary folder beside the others and renamed into place in one step, so a reader never sees half of one
and two jobs registering at once never collide (ids are unique per process and time). The default store is
the user's data directory (``$CONVEYOR_DATA/models``, else ``~/.local/share/conveyor/models``); a folder on
a shared file system works the same way, as rename is atomic there too.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from conveyor.errors import InputError
from conveyor.paths import data_dir

__all__ = ["ModelEntry", "ModelStore", "default_model_store"]


def default_model_store() -> Path:
    """``$CONVEYOR_DATA/models``, else the user's data directory's (``~/.local/share/conveyor/models``)."""
    return data_dir() / "models"


@dataclass(frozen=True)
class ModelEntry:
    """One stored model: its id, name (e.g. ``mlp``), accuracy, architecture (an operator graph as JSON), how
    it was trained (``info``: model options, dataset, epochs, run folder) and when it was stored."""

    id: str
    name: str
    accuracy: float
    graph: dict[str, Any]
    info: dict[str, Any] = field(default_factory=dict)
    created: float = 0.0

    def parameters(self) -> int:
        """Parameter elements in its graph (the sum over its layers' shapes)."""
        nodes = self.graph.get("nodes", [])
        return sum(math.prod(shape) for node in nodes for shape in node.get("params", {}).values())


class ModelStore:
    """The store in folder ``root`` (default :func:`default_model_store`).

    Example:
        >>> import tempfile, torch
        >>> folder = Path(tempfile.mkdtemp())
        >>> torch.save({"model": {}}, folder / "ckpt.pt")
        >>> store = ModelStore(folder / "models")
        >>> entry = store.register(folder / "ckpt.pt", "mlp", 0.95, {"nodes": []}, {"width": 16})
        >>> [e.name for e in store.list()], store.get(entry.id).accuracy
        (['mlp'], 0.95)
    """

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_model_store()

    def register(
        self,
        checkpoint: Path | str,
        name: str,
        accuracy: float,
        graph: Mapping[str, Any],
        info: Mapping[str, Any] | None = None,
    ) -> ModelEntry:
        """Copy ``checkpoint`` into the store with what describes it; return its entry."""
        checkpoint = Path(checkpoint)
        if not checkpoint.is_file():
            raise FileNotFoundError(f"no checkpoint at {checkpoint} to store: train first, or give its path")
        if not 0.0 <= accuracy <= 1.0:
            raise InputError(f"a stored model's accuracy must be in [0, 1], got {accuracy}")
        self.root.mkdir(parents=True, exist_ok=True)
        created = time.time()
        model_id = f"{name.replace('/', '-').replace(':', '-')}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        entry = ModelEntry(model_id, name, float(accuracy), dict(graph), dict(info or {}), created)
        staging = Path(tempfile.mkdtemp(prefix=f".{model_id}.", dir=self.root))
        try:
            shutil.copyfile(checkpoint, staging / "model.pt")
            (staging / "entry.json").write_text(json.dumps({**asdict(entry), "host": socket.gethostname()}))
            target = self.root / model_id
            suffix = 0
            while target.exists():  # the same name, second and process: a second model of one job
                suffix += 1
                target = self.root / f"{model_id}-{suffix}"
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return ModelEntry(target.name, name, entry.accuracy, entry.graph, entry.info, created)

    def list(self) -> list[ModelEntry]:
        """Every stored model, oldest first (folders being written are not shown)."""
        if not self.root.is_dir():
            return []
        entries = [self._read(p) for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return sorted((e for e in entries if e is not None), key=lambda e: (e.created, e.id))

    def get(self, model_id: str) -> ModelEntry:
        """The model ``model_id``."""
        entry = self._read(self.root / model_id)
        if entry is None:
            raise InputError(f"no model {model_id!r} in {self.root}: `conveyor models list` shows the stored ones")
        return entry

    def checkpoint(self, model_id: str) -> Path:
        """The stored checkpoint of ``model_id``."""
        self.get(model_id)
        return self.root / model_id / "model.pt"

    def remove(self, model_id: str) -> None:
        """Delete ``model_id`` (renamed aside first, so readers never see half of it)."""
        self.get(model_id)
        doomed = self.root / f".removing-{model_id}-{os.getpid()}"
        (self.root / model_id).rename(doomed)
        shutil.rmtree(doomed)

    @staticmethod
    def _read(folder: Path) -> ModelEntry | None:
        try:
            data = json.loads((folder / "entry.json").read_text())
        except (OSError, ValueError):
            return None
        data.pop("host", None)
        return ModelEntry(**{**data, "id": folder.name})
