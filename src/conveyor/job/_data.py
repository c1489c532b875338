"""Datasets that need no download: scikit-learn's digits, and a text corpus for language models.

``digits`` is scikit-learn's 1797 handwritten 8x8 digits (shipped with the package), as flat vectors
(``digits``) or 1-channel images (``digit-images``). ``text`` is Python's own reference documentation
(``pydoc_data.topics``, shipped with every CPython), or any UTF-8 file (``text:PATH``), cut into
character windows whose target is the next character. The bundled corpus has a fixed vocabulary of 101:
ASCII's 100 printable characters and one for any other (CPython 3.11's topics hold 103 distinct characters,
3.12's 104, so a vocabulary read off the corpus would change a model's size with the Python version); a file's
vocabulary is its own characters. With torchvision installed and the files on
disk, ``torchvision:NAME:ROOT`` loads one of its image datasets (``torchvision:CIFAR10:~/data``); no
download happens at run time. ``synthetic-images`` (3x32x32, CIFAR's shape) and ``synthetic-text`` (windows
of 256 tokens over GPT-2's vocabulary of 50,257) are drawn from the seed, sized to measure GPU-sized models
(``resnet18``, ``gpt2``); each has a pattern to learn (a class's image is its own template plus noise; a token
mostly follows from the one before), so accuracy rises, but they stand for no real task;
``synthetic:SHAPE:CLASSES:N`` draws ``N`` such samples of any shape (``synthetic:3x64x64:100:4096``).
``imagefolder:PATH`` reads a folder of images, one subfolder per class (torchvision's ImageFolder layout), with
Pillow, into memory: ``PATH/train/CLASS/*`` and ``PATH/test/CLASS/*`` (or ``val``) where those exist, else
``PATH/CLASS/*`` split 80:20; every image converted to RGB and resized to the first one's size. ``hf:PATH`` reads
a Hugging Face dataset saved with ``save_to_disk`` (images and labels, or tokenised text: see
:mod:`conveyor.job._hf_data`).

Example:
    >>> d = load("digits")
    >>> tuple(d.train_x.shape), d.classes
    ((1437, 64), 10)
"""

from __future__ import annotations

import importlib
import importlib.util
import string
from pathlib import Path

import numpy as np
import torch

from conveyor.errors import InputError
from conveyor.job._dataset import Dataset, Inputs, rows
from conveyor.job._hf_data import load_hf, rgb_stack

__all__ = ["DATASETS", "Dataset", "Inputs", "digits_table", "load", "rgb_stack", "rows"]

DATASETS = (
    "digits",
    "digit-images",
    "text",
    "text:PATH",
    "torchvision:NAME:ROOT",
    "synthetic-images",
    "synthetic-text",
    "synthetic:SHAPE:CLASSES:N",
    "imagefolder:PATH",
    "hf:PATH",
)
OTHER_CHARACTER = "\ufffd"  # the bundled text's one token for every character outside printable ASCII
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
GPT2_VOCAB = 50257


def _split(name: str, x: torch.Tensor, y: torch.Tensor, *, classes: int, seed: int, sequence: bool = False) -> Dataset:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    cut = int(0.8 * len(x))
    return Dataset(name, x[:cut], y[:cut], x[cut:], y[cut:], classes, sequence)


def digits_table() -> np.ndarray:
    """The 1797 digits, a row each: 64 pixels (0 to 16) and the label. Read straight from the CSV scikit-learn
    ships, the file its ``load_digits`` reads after importing scikit-learn, which takes 1.5 s on a 2-core machine
    (scipy.stats), once per worker; ``load_digits`` itself where the file is not found."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.origin is not None:
        shipped = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if shipped.exists():
            return np.loadtxt(shipped, delimiter=",")
    from sklearn.datasets import load_digits

    data = load_digits()
    return np.column_stack([data.data, data.target])


def _digits(images: bool, seed: int) -> Dataset:
    table = digits_table()
    x = torch.tensor(table[:, :64], dtype=torch.float32) / 16.0
    if images:
        x = x.reshape(-1, 1, 8, 8)
    y = torch.tensor(table[:, 64].astype(np.int64))
    return _split("digit-images" if images else "digits", x, y, classes=10, seed=seed)


def _text(path: str | None, context: int, seed: int, limit: int = 4000) -> Dataset:
    """Up to ``limit`` windows of ``context`` characters, spread evenly over the corpus."""
    if path is None:
        from pydoc_data.topics import topics

        text, name = "\n".join(topics[k] for k in sorted(topics)), "text"
        vocab = [*sorted(string.printable), OTHER_CHARACTER]
        text = "".join(c if c in string.printable else OTHER_CHARACTER for c in text)
    else:
        try:
            text, name = Path(path).expanduser().read_text(encoding="utf-8"), f"text:{path}"
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"cannot read the text corpus {path}: {exc}; give a UTF-8 text file") from exc
        vocab = sorted(set(text))
    if len(text) < 2 * (context + 1):
        raise InputError(f"the text corpus {name} has {len(text)} characters; it needs at least {2 * (context + 1)}")
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text])
    starts = torch.linspace(0, len(ids) - context - 1, min(limit, len(ids) - context)).long()
    windows = torch.stack([ids[s : s + context + 1] for s in starts.tolist()])
    return _split(name, windows[:, :-1], windows[:, 1:], classes=len(vocab), seed=seed, sequence=True)


def _torchvision(name: str, root: str) -> Dataset:
    try:
        datasets = importlib.import_module("torchvision.datasets")
        transforms = importlib.import_module("torchvision.transforms")
    except ImportError as exc:
        raise InputError(f"torchvision:{name} needs torchvision installed ({exc})") from exc
    cls = getattr(datasets, name, None)
    if cls is None:
        raise InputError(f"torchvision has no dataset {name!r}")
    parts = []
    for train in (True, False):
        try:
            ds = cls(Path(root).expanduser(), train=train, download=False, transform=transforms.ToTensor())
        except (RuntimeError, OSError) as exc:
            raise InputError(f"cannot load torchvision {name} from {root}: {exc} (no download at run time)") from exc
        loader = torch.utils.data.DataLoader(ds, batch_size=len(ds))
        parts += list(next(iter(loader)))
    classes = int(max(parts[1].max(), parts[3].max())) + 1
    return Dataset(f"torchvision:{name}", parts[0], parts[1], parts[2], parts[3], classes)


def _synthetic_images(
    seed: int, samples: int = 6144, classes: int = 10, shape: tuple[int, ...] = (3, 32, 32), name: str = ""
) -> Dataset:
    """Each class a random template of ``shape``; a sample its class's template plus as much noise."""
    g = torch.Generator().manual_seed(seed)
    templates = torch.randn(classes, *shape, generator=g)
    labels = torch.randint(classes, (samples,), generator=g)
    images = templates[labels] + torch.randn(samples, *shape, generator=g)
    return _split(name or "synthetic-images", images, labels, classes=classes, seed=seed)


def _synthetic(spec: str, seed: int) -> Dataset:
    """``synthetic:SHAPE:CLASSES:N``, e.g. ``synthetic:3x64x64:100:4096``."""
    parts = spec.split(":")
    try:
        shape = tuple(int(d) for d in parts[1].split("x"))
        classes, samples = int(parts[2]), int(parts[3])
        if len(parts) != 4 or min(*shape, classes, samples) < 1 or classes < 2 or samples < 10:
            raise ValueError
    except (ValueError, IndexError):
        raise InputError(
            f"dataset {spec!r}: give synthetic:SHAPE:CLASSES:N, e.g. synthetic:3x64x64:100:4096 (2 classes or more, "
            "10 samples or more)"
        ) from None
    return _synthetic_images(seed, samples, classes, shape, spec)


def _image_files(folder: Path) -> dict[str, list[Path]]:
    """Each class subfolder's images, the classes sorted by name."""
    classes = sorted(d for d in folder.iterdir() if d.is_dir())
    return {d.name: sorted(f for f in d.rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES) for d in classes}


def _read_images(
    files: dict[str, list[Path]], names: list[str], size: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int] | None]:
    from PIL import Image

    images, labels = [], []
    for label, name in enumerate(names):
        for file in files.get(name, []):
            with Image.open(file) as image:
                image.load()
                images.append(image)
            labels.append(label)
    x, size = rgb_stack(images, size)
    return x, torch.tensor(labels, dtype=torch.long), size


def _image_folder(root: str, seed: int) -> Dataset:
    folder = Path(root).expanduser()
    if not folder.is_dir():
        raise InputError(f"imagefolder:{root}: no such folder (give one with a subfolder of images per class)")
    held_out = next((folder / s for s in ("test", "val") if (folder / s).is_dir()), None)
    if (folder / "train").is_dir() and held_out is not None:
        train, test = _image_files(folder / "train"), _image_files(held_out)
    else:
        train, test = _image_files(folder), {}
    names = sorted(set(train) | set(test))
    if len(names) < 2 or sum(len(f) for f in train.values()) < 2:
        raise InputError(
            f"imagefolder:{root}: found {len(names)} class folders with {sum(len(f) for f in train.values())} "
            f"images ({', '.join(IMAGE_SUFFIXES)}); give PATH/CLASS/IMAGE, two classes or more"
        )
    x, y, size = _read_images(train, names, None)
    if not test:
        return _split(f"imagefolder:{root}", x, y, classes=len(names), seed=seed)
    test_x, test_y, _ = _read_images(test, names, size)
    return Dataset(f"imagefolder:{root}", x, y, test_x, test_y, len(names))


def _synthetic_text(seed: int, samples: int = 2048, context: int = 256, vocab: int = GPT2_VOCAB) -> Dataset:
    """Windows of ``context + 1`` tokens where a token is ``(31 t + 7) mod vocab`` of the one before, or one drawn
    at random in one case of ten."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.empty(samples, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(vocab, (samples,), generator=g)
    for t in range(context):
        follows = (31 * tokens[:, t] + 7) % vocab
        noise = torch.rand(samples, generator=g) < 0.1
        tokens[:, t + 1] = torch.where(noise, torch.randint(vocab, (samples,), generator=g), follows)
    return _split("synthetic-text", tokens[:, :-1], tokens[:, 1:], classes=vocab, seed=seed, sequence=True)


def load(spec: str, seed: int = 0, context: int = 32) -> Dataset:
    """Load a dataset by name (see :data:`DATASETS`); ``context`` is the window length for text.

    Raises:
        ValueError: an unknown name, or a file or dataset that cannot be read.
    """
    if spec in ("digits", "digit-images"):
        return _digits(spec == "digit-images", seed)
    if spec == "synthetic-images":
        return _synthetic_images(seed)
    if spec == "synthetic-text":
        return _synthetic_text(seed)
    if spec == "text" or spec.startswith("text:"):
        return _text(spec[5:] or None, context, seed)
    if spec.startswith("synthetic:"):
        return _synthetic(spec, seed)
    if spec.startswith("imagefolder:"):
        return _image_folder(spec.removeprefix("imagefolder:"), seed)
    if spec.startswith("torchvision:") and spec.count(":") == 2:
        _, name, root = spec.split(":")
        return _torchvision(name, root)
    if spec.startswith("hf:"):
        return load_hf(spec[3:], seed, context)
    raise InputError(f"unknown dataset {spec!r}: use one of {', '.join(DATASETS)}")
