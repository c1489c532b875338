"""``hf:PATH``: Hugging Face datasets saved with ``save_to_disk``, built here on the fly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conveyor.job._data import load

datasets = pytest.importorskip("datasets", reason="Hugging Face datasets is not installed (pip install '.[models]')")


def _images(count: int, sizes: tuple[tuple[int, int], ...]) -> list[object]:
    from PIL import Image

    rng = np.random.default_rng(0)
    return [
        Image.fromarray(rng.integers(0, 256, (*sizes[i % len(sizes)][::-1], 3), dtype=np.uint8)) for i in range(count)
    ]


def test_images_and_class_labels_with_their_own_splits(tmp_path: Path) -> None:
    features = datasets.Features({"img": datasets.Image(), "kind": datasets.ClassLabel(names=["a", "b", "c"])})
    train = datasets.Dataset.from_dict({"img": _images(6, ((8, 6), (10, 7))), "kind": [0, 1, 2, 0, 1, 2]}, features)
    test = datasets.Dataset.from_dict({"img": _images(2, ((9, 9),)), "kind": [2, 1]}, features)
    datasets.DatasetDict({"train": train, "validation": test}).save_to_disk(str(tmp_path / "pics"))
    d = load(f"hf:{tmp_path / 'pics'}")
    assert (len(d.train_x), len(d.test_x), d.classes, d.sequence) == (6, 2, 3, False)
    assert d.train_x.shape[1:] == d.test_x.shape[1:] == (3, 6, 8)  # all resized to the first image's (8 wide, 6 high)
    assert d.train_y.tolist() == [0, 1, 2, 0, 1, 2] and d.test_y.tolist() == [2, 1]
    first = np.array(_images(1, ((8, 6),))[0].convert("RGB"))  # type: ignore[attr-defined]
    torch.testing.assert_close(d.train_x[0], torch.from_numpy(first).permute(2, 0, 1).float() / 255)


def test_token_rows_of_one_length_are_windows_and_the_next_token_is_the_target(tmp_path: Path) -> None:
    rows = [[i, i + 1, i + 2, i + 3, i + 4] for i in range(10)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "lm"))
    d = load(f"hf:{tmp_path / 'lm'}", seed=3)
    assert (len(d.train_x), len(d.test_x), d.sequence, d.classes) == (8, 2, True, 14)  # one split cut 80:20
    assert d.train_x.shape == (8, 4)
    torch.testing.assert_close(d.train_y, d.train_x + 1)  # each row counts up: the target is the next token
    assert sorted(torch.cat([d.train_x, d.test_x])[:, 0].tolist()) == list(range(10))


def test_ragged_token_rows_are_joined_and_cut_into_windows_of_the_context(tmp_path: Path) -> None:
    rows = [list(range(n * 10, n * 10 + 3 + n)) for n in range(8)]  # 3 to 10 tokens
    part = datasets.Dataset.from_dict({"input_ids": rows})
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(tmp_path / "ragged"))
    d = load(f"hf:{tmp_path / 'ragged'}", context=4)
    joined = [t for r in rows for t in r]
    assert d.train_x.shape == (len(joined) // 5, 4)
    assert d.train_x[1].tolist() == joined[5:9] and d.train_y[1].tolist() == joined[6:10]


def test_token_rows_with_labels_are_sequence_classification(tmp_path: Path) -> None:
    part = datasets.Dataset.from_dict({"input_ids": [[1, 2, 0], [3, 4, 5]] * 3, "label": [0, 1] * 3})
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(tmp_path / "cls"))
    d = load(f"hf:{tmp_path / 'cls'}")
    assert (d.train_x.shape, d.classes, d.sequence, d.train_y.tolist()) == ((6, 3), 2, False, [0, 1] * 3)


def test_an_attention_mask_makes_each_input_a_dict_of_both(tmp_path: Path) -> None:
    ids, mask = [[5, 6, 0], [7, 0, 0]] * 5, [[1, 1, 0], [1, 0, 0]] * 5
    datasets.Dataset.from_dict({"input_ids": ids, "attention_mask": mask, "label": [1, 0] * 5}).save_to_disk(
        str(tmp_path / "masked")
    )
    d = load(f"hf:{tmp_path / 'masked'}")
    assert isinstance(d.train_x, dict) and sorted(d.train_x) == ["attention_mask", "input_ids"]
    assert d.samples == 8 and d.train_x["input_ids"].shape == d.train_x["attention_mask"].shape == (8, 3)
    for i in range(8):  # each row's mask stays with its ids and its label
        row = d.train_x["input_ids"][i].tolist()
        assert d.train_x["attention_mask"][i].tolist() == [int(t != 0) for t in row]
        assert int(d.train_y[i]) == (1 if row[0] == 5 else 0)
    with pytest.raises(
        ValueError, match=r"one input tensor is needed for the zoo's models, and .* gives input_ids, attention_mask"
    ):
        d.tensor_inputs("the zoo's models")


def test_token_rows_with_token_labels_are_sequence_to_sequence(tmp_path: Path) -> None:
    """The labels are the targets and an input the model takes by name (its decoder's, shifted right)."""
    ids, labels = [[5, 6, 7], [8, 9, 3]] * 5, [[7, 6, -100, -100], [3, 9, 8, -100]] * 5
    part = datasets.Dataset.from_dict({"input_ids": ids, "labels": labels})
    datasets.DatasetDict({"train": part, "test": part}).save_to_disk(str(tmp_path / "pairs"))
    d = load(f"hf:{tmp_path / 'pairs'}")
    assert isinstance(d.train_x, dict) and sorted(d.train_x) == ["input_ids", "labels"]
    assert (d.sequence, d.classes, d.train_y.shape) == (True, 10, (10, 4))
    assert torch.equal(d.train_x["labels"], d.train_y) and d.train_y[0].tolist() == [7, 6, -100, -100]


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"text": ["a b", "c d"] * 5}, "has columns text: give an image column"),
        ({"input_ids": [[1, 2], [3]] * 5, "label": [0, 1] * 5}, "differ in length; pad them"),
        ({"input_ids": [[1], [2, 3]] * 5}, "too few tokens for one window of 33"),
        ({"input_ids": [[1, 2]] * 10, "labels": [[1], [2, 3]] * 5}, "the labels rows differ in length; pad them"),
    ],
)
def test_datasets_that_cannot_be_trained_on_say_why(
    tmp_path: Path, columns: dict[str, list[object]], message: str
) -> None:
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match=message):
        load(f"hf:{tmp_path / 'bad'}")
    with pytest.raises(ValueError, match="cannot load a dataset saved with save_to_disk"):
        load(f"hf:{tmp_path / 'nothing'}")


def test_loading_leaves_no_process_lock_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker ends with ``os._exit``: a semaphore made by a progress bar would be left to the resource tracker."""
    import multiprocessing.synchronize

    from tqdm import tqdm

    made: list[object] = []
    original = multiprocessing.synchronize.SemLock.__init__
    monkeypatch.setattr(
        multiprocessing.synchronize.SemLock,
        "__init__",
        lambda self, *a, **k: made.append(self) or original(self, *a, **k),
    )
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 10}).save_to_disk(str(tmp_path / "lm"))
    load(f"hf:{tmp_path / 'lm'}")
    assert made == [] and "_lock" not in vars(tqdm)
