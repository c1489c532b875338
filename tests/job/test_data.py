"""Bundled datasets: digits as vectors and images, Python's documentation and user files as text."""

from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.job._data import load


def test_digits_and_images_are_the_same_split() -> None:
    flat, images = load("digits"), load("digit-images")
    assert flat.train_x.shape == (1437, 64) and images.train_x.shape == (1437, 1, 8, 8)
    torch.testing.assert_close(images.train_x.flatten(1), flat.train_x)
    assert flat.classes == 10 and not flat.sequence
    assert load("digits", seed=1).train_y.tolist() != flat.train_y.tolist()


def test_text_windows_predict_the_next_character(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("abcdefgh" * 50)
    d = load(f"text:{corpus}", context=8)
    assert d.sequence and d.classes == 8
    torch.testing.assert_close(d.train_x[:, 1:], d.train_y[:, :-1])  # targets are the inputs shifted by one
    assert d.train_x.shape[1] == 8
    bundled = load("text")
    assert bundled.classes > 50 and len(bundled.train_x) + len(bundled.test_x) == 4000


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("mnist", "unknown dataset 'mnist'"),
        ("text:/no/such/file.txt", "cannot read the text corpus"),
        ("torchvision:NoSuchSet:/tmp", "torchvision"),
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
