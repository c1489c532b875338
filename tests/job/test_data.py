"""Bundled datasets: digits as vectors and images, Python's documentation and user files as text; folders of
images; synthetic samples of any shape."""

import string
from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.job import Dataset
from conveyor.job._data import load


def test_digits_and_images_are_the_same_split() -> None:
    flat, images = load("digits"), load("digit-images")
    assert flat.train_x.shape == (1437, 64) and images.train_x.shape == (1437, 1, 8, 8)
    torch.testing.assert_close(images.train_x.flatten(1), flat.train_x)
    assert flat.classes == 10 and not flat.sequence
    assert load("digits", seed=1).train_y.tolist() != flat.train_y.tolist()


def test_a_subset_draws_training_samples_and_keeps_the_test_split() -> None:
    whole = load("digits")
    some = whole.subset(100, seed=3)
    assert some.samples == 100 and torch.equal(some.test_x, whole.test_x) and torch.equal(some.test_y, whole.test_y)
    rows = {tuple(r) for r in whole.train_x.tolist()}
    assert all(tuple(r) in rows for r in some.train_x.tolist())  # samples of the training split, each with its label
    pairs = {(tuple(x), int(y)) for x, y in zip(whole.train_x.tolist(), whole.train_y.tolist(), strict=True)}
    assert all((tuple(x), int(y)) in pairs for x, y in zip(some.train_x.tolist(), some.train_y.tolist(), strict=True))
    by_class = Dataset("sorted", torch.arange(100.0)[:, None], torch.arange(100) // 10, whole.test_x, whole.test_y, 10)
    assert len(set(by_class.subset(20, seed=0).train_y.tolist())) > 2  # drawn, not the first rows (classes 0, 1)
    assert torch.equal(whole.subset(100, seed=3).train_x, some.train_x)  # seeded
    assert not torch.equal(whole.subset(100, seed=4).train_x, some.train_x)
    assert whole.subset(5000, seed=3) is whole  # asking for more keeps them all


def test_text_windows_predict_the_next_character(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefgh" * 50)
    d = load(f"text:{corpus}", context=8)
    assert d.sequence and d.classes == 8
    torch.testing.assert_close(d.train_x[:, 1:], d.train_y[:, :-1])  # targets are the inputs shifted by one
    assert d.train_x.shape[1] == 8
    bundled = load("text")
    assert len(bundled.train_x) + len(bundled.test_x) == 4000


def test_the_bundled_text_has_one_vocabulary_whatever_the_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """Printable ASCII and one token for the rest, whichever characters this CPython's topics hold (3.11's 103
    distinct, 3.12's 104): a model sized for it fits on every Python."""
    import pydoc_data.topics

    assert load("text").classes == 101
    monkeypatch.setattr(pydoc_data.topics, "topics", {"b": "Caf\u00e9 \u2014 na\u00efve\n" * 40, "a": "~$"})
    small = load("text", context=4)
    assert small.classes == 101
    ids = torch.cat([small.train_x, small.train_y, small.test_x, small.test_y]).unique().tolist()
    order = sorted(string.printable)
    expected = {order.index(c) for c in "~$Caf na ve\n"} | {len(string.printable)}  # the last id: any other
    assert set(ids) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mnist", "unknown dataset 'mnist'"),
        ("text:/no/such/file.txt", "cannot read the text corpus"),
        ("torchvision:NoSuchSet:/tmp", "torchvision"),
        ("synthetic:3x4:1:20", "give synthetic:SHAPE:CLASSES:N"),
        ("synthetic:3xa:2:20", "give synthetic:SHAPE:CLASSES:N"),
        ("imagefolder:/no/such/folder", "imagefolder:/no/such/folder: no such folder"),
    ],
)
def test_bad_datasets(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load(spec)


def test_the_digits_read_from_scikit_learns_file_are_load_digits(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from sklearn.datasets import load_digits

    from conveyor.job._data import digits_table

    data = load_digits()
    expected = np.column_stack([data.data, data.target])
    assert np.array_equal(digits_table(), expected)  # the shipped CSV, read without importing scikit-learn
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # the file not found: load_digits
    assert np.array_equal(digits_table(), expected)


def _images(folder: Path, classes: dict[str, int], size: tuple[int, int] = (10, 12)) -> None:
    """``count`` random RGB images per class under ``folder/CLASS/``; the first of each ``size`` (width,
    height), the others 2 pixels larger, so they are resized."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, count in classes.items():
        (folder / name).mkdir(parents=True)
        for i in range(count):
            w, h = size if i == 0 else (size[0] + 2, size[1] + 2)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / name / f"{i}.png")


def test_an_image_folder_is_read_resized_and_split(tmp_path: Path) -> None:
    _images(tmp_path / "flat", {"cat": 6, "dog": 4})
    d = load(f"imagefolder:{tmp_path / 'flat'}")
    assert d.classes == 2 and len(d.train_x) + len(d.test_x) == 10 and len(d.train_x) == 8
    assert d.train_x.shape[1:] == (3, 12, 10) and float(d.train_x.min()) >= 0.0 and float(d.train_x.max()) <= 1.0
    assert sorted(torch.cat([d.train_y, d.test_y]).tolist()) == [0] * 6 + [1] * 4  # classes by folder name
    _images(tmp_path / "split" / "train", {"a": 3, "b": 3, "c": 2})
    _images(tmp_path / "split" / "val", {"a": 1, "c": 2})
    d = load(f"imagefolder:{tmp_path / 'split'}")
    assert (len(d.train_x), len(d.test_x), d.classes) == (8, 3, 3)
    assert d.test_y.tolist() == [0, 2, 2]  # the held-out folder's classes numbered as the training folder's
    with pytest.raises(ValueError, match="found 0 class folders"):
        load(f"imagefolder:{tmp_path / 'flat' / 'cat'}")


def test_synthetic_samples_of_any_shape() -> None:
    d = load("synthetic:1x5x6:4:50")
    assert d.train_x.shape == (40, 1, 5, 6) and d.classes == 4 and int(d.train_y.max()) < 4
    torch.testing.assert_close(load("synthetic:1x5x6:4:50").train_x, d.train_x)  # drawn from the seed
