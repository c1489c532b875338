"""``hf:PATH``: a Hugging Face dataset saved with ``save_to_disk``, read into memory with ``datasets``.

Its ``train`` and ``test`` (or ``validation``) splits are used where the saved dataset has them, else its one split
is cut 80:20 from the seed. What it holds decides the task:

- an image column (``datasets.Image``) and a label column (``datasets.ClassLabel``, or one named ``label`` or
  ``labels``): image classification, every image converted to RGB and resized to the first one's size;
- an ``input_ids`` column and a label column: sequence classification, the rows all of one length (padded by the
  tokenizer); with an ``attention_mask`` column, each batch is a dict of both, given to the model by name
  (``model(input_ids=..., attention_mask=...)``);
- an ``input_ids`` column and a ``labels`` column of token ids per row: sequence to sequence (T5, BART); each batch is
  a dict of ``input_ids`` (with ``attention_mask`` where there is one) and ``labels``, given to the model by name:
  an encoder-decoder model makes its decoder's inputs from the labels, shifted right, as transformers does. The
  targets are the labels, ``-100`` where a position is padding (not scored);
- an ``input_ids`` column alone: language modelling, the next token the target. Rows of one length are windows
  already (as ``run_clm``'s ``group_texts`` leaves them); rows of several lengths are joined and cut into windows of
  ``context`` tokens.

Text must be tokenised first (``datasets.map`` with the model's tokenizer): Conveyor does not guess a tokenizer.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conveyor.errors import InputError
from conveyor.job._dataset import Dataset, Inputs

__all__ = ["load_hf", "rgb_stack"]

LABEL_NAMES = ("label", "labels")


def _splits(saved: Any, seed: int) -> tuple[Any, Any]:
    """The train and test splits of a saved ``Dataset`` or ``DatasetDict``."""
    if not hasattr(saved, "keys"):  # one Dataset
        parts = saved.train_test_split(test_size=0.2, seed=seed)
        return parts["train"], parts["test"]
    held_out = next((s for s in ("test", "validation") if s in saved), None)
    if "train" in saved and held_out is not None:
        return saved["train"], saved[held_out]
    only = saved["train"] if "train" in saved else saved[next(iter(saved.keys()))]
    parts = only.train_test_split(test_size=0.2, seed=seed)
    return parts["train"], parts["test"]


def _columns(train: Any) -> tuple[str | None, str | None]:
    """The image column and the label column, ``None`` where there is none."""
    import datasets

    features = train.features
    image = next((k for k, f in features.items() if isinstance(f, datasets.Image)), None)
    label = next((k for k, f in features.items() if isinstance(f, datasets.ClassLabel)), None)
    return image, label or next((k for k in LABEL_NAMES if k in features), None)


def _classes(train: Any, label: str, ys: list[torch.Tensor]) -> int:
    feature = train.features[label]
    return int(getattr(feature, "num_classes", 0) or max(int(y.max()) for y in ys if len(y)) + 1)


def _token_rows(part: Any, name: str) -> list[list[int]]:
    rows: list[list[int]] = list(part["input_ids"])  # a list, not datasets' lazy column
    if not rows or not isinstance(rows[0], list):
        raise InputError(f"{name}: input_ids must hold a list of token ids per row")
    return rows


def _inputs(part: Any, ids: list[list[int]]) -> Inputs:
    """The token ids, with the attention mask by name where the dataset has one."""
    if "attention_mask" not in part.features:
        return torch.tensor(ids)
    return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(list(part["attention_mask"]))}


def _windows(rows: list[list[int]], context: int) -> torch.Tensor:
    """``(N, L)`` token windows: the rows themselves where they are of one length, else the rows joined and cut."""
    if len({len(r) for r in rows}) == 1:
        return torch.tensor(rows, dtype=torch.long)
    joined = torch.tensor([t for r in rows for t in r], dtype=torch.long)
    count = len(joined) // (context + 1)
    return joined[: count * (context + 1)].view(count, context + 1)


def rgb_stack(images: Any, size: tuple[int, int] | None) -> tuple[torch.Tensor, tuple[int, int] | None]:
    """PIL images as one ``(N, 3, H, W)`` float tensor in [0, 1], each converted to RGB and resized to ``size``
    (width, height; the first image's where ``None``)."""
    arrays = []
    for image in images:
        rgb = image.convert("RGB")
        size = size or rgb.size
        arrays.append(np.asarray(rgb.resize(size) if rgb.size != size else rgb))
    x = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float().div(255) if arrays else torch.empty(0)
    return x, size


@contextlib.contextmanager
def _progress_bars_locked_by_a_thread_lock() -> Iterator[None]:
    """Without this, datasets' progress bars make tqdm's process lock, a POSIX semaphore that a worker ending with
    ``os._exit`` leaves behind for the launcher's resource tracker to warn of at shutdown."""
    from tqdm import tqdm

    ours = "_lock" not in vars(tqdm)
    if ours:
        tqdm.set_lock(threading.RLock())
    try:
        yield
    finally:
        if ours:
            del tqdm._lock


def load_hf(root: str, seed: int, context: int) -> Dataset:
    """The dataset saved at ``root`` (see the module docstring)."""
    name = f"hf:{root}"
    try:
        import datasets
    except ImportError as exc:
        raise InputError(f"{name} needs Hugging Face datasets: pip install 'conveyor[models]' ({exc})") from exc
    with _progress_bars_locked_by_a_thread_lock():
        try:
            saved = datasets.load_from_disk(str(Path(root).expanduser()))
        except (FileNotFoundError, OSError, ValueError) as exc:
            raise InputError(f"{name}: cannot load a dataset saved with save_to_disk there ({exc})") from exc
        return _tensors(name, *_splits(saved, seed), context)


def _tensors(name: str, train: Any, test: Any, context: int) -> Dataset:
    image, label = _columns(train)
    if image is not None and label is not None:
        train_x, size = rgb_stack(train[image], None)
        ys = [torch.tensor(list(part[label])) for part in (train, test)]
        return Dataset(name, train_x, ys[0], rgb_stack(test[image], size)[0], ys[1], _classes(train, label, ys))
    if "input_ids" not in train.features:
        raise InputError(
            f"{name} has columns {', '.join(train.features)}: give an image column and a label column, or an "
            "input_ids column (tokenise text first with datasets.map and the model's tokenizer)"
        )
    rows = [_token_rows(part, name) for part in (train, test)]
    if label is not None and isinstance(train[0][label], list):
        return _seq2seq(name, (train, test), rows, label)
    if label is not None:
        if len({len(r) for r in rows[0] + rows[1]}) != 1:
            raise InputError(f"{name}: the input_ids rows differ in length; pad them to one (padding='max_length')")
        xs = [_inputs(part, r) for part, r in zip((train, test), rows, strict=True)]
        ys = [torch.tensor(list(part[label])) for part in (train, test)]
        return Dataset(name, xs[0], ys[0], xs[1], ys[1], _classes(train, label, ys))
    windows = [_windows(r, context) for r in rows]
    if min(len(w) for w in windows) == 0:
        raise InputError(f"{name}: too few tokens for one window of {context + 1} in each split")
    vocab = int(max(int(w.max()) for w in windows)) + 1
    train_w, test_w = windows
    return Dataset(name, train_w[:, :-1], train_w[:, 1:], test_w[:, :-1], test_w[:, 1:], vocab, sequence=True)


def _seq2seq(name: str, parts: tuple[Any, Any], rows: list[list[list[int]]], label: str) -> Dataset:
    """Source token ids and target token ids per row (see the module docstring)."""
    targets = [[list(r) for r in part[label]] for part in parts]
    for what, grid in (("input_ids", rows[0] + rows[1]), (label, targets[0] + targets[1])):
        if len({len(r) for r in grid}) != 1:
            raise InputError(f"{name}: the {what} rows differ in length; pad them to one (padding='max_length')")
    ys = [torch.tensor(t, dtype=torch.long) for t in targets]
    xs: list[Inputs] = []
    for part, ids, y in zip(parts, rows, ys, strict=True):
        inputs = _inputs(part, ids)
        xs.append({**(inputs if isinstance(inputs, dict) else {"input_ids": inputs}), "labels": y})
    classes = max(max(max(r) for r in rows[0] + rows[1]), *(int(y.max()) for y in ys)) + 1
    return Dataset(name, xs[0], ys[0], xs[1], ys[1], classes, sequence=True)
