"""Models by name: an MLP, a VGG-style, a VGG-16-shaped and a ResNet-style CNN, a small GPT; two GPU-sized
ones, ResNet-18 and GPT-2 small's shape; or a user's ``module:factory``.

Every model is an ``nn.Sequential`` of blocks, each block's output the next one's input, so a pipeline
can cut it anywhere. The first five are sized to train on a CPU in seconds; ``resnet18`` (11.2M weights, on
3x32x32 images) and ``gpt2`` (12 blocks 768 wide, 12 heads, 163M weights with its untied head, on windows of
256 tokens) to keep a GPU busy. All scale by ``width`` and ``depth``.

A user's ``module:factory`` takes the batch size (a parameter named ``batch_size``) and returns ``(model,
example_batch)``; any other callable (a library's constructor, ``torchvision.models:resnet18``) is called with
``--model-args`` alone and returns the model, whose example batch then comes from the dataset; a Hugging Face
model class (``transformers:GPT2LMHeadModel``) is given its own configuration class made from ``--model-args``.
An ``nn.Sequential`` or a list of blocks is cut between its blocks; any other module is split by
:func:`conveyor.runtime.split_model` (traced with ``torch.export``), and a model that returns a mapping (a
Hugging Face ``ModelOutput``) is trained on its ``logits``.

Example:
    >>> from conveyor.job._data import load
    >>> model = build("resnet", load("digit-images"))
    >>> model(torch.zeros(2, 1, 8, 8)).shape
    torch.Size([2, 10])
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.config import model_arguments
from conveyor.errors import InputError
from conveyor.job._data import Dataset, load, rows
from conveyor.job._fit import check_causal, check_classes, is_mapping
from conveyor.runtime import GraphBlock, split_model

__all__ = [
    "MODELS",
    "Logits",
    "ResidualBlock",
    "TransformerBlock",
    "build",
    "default_dataset",
    "gpt",
    "load_factory",
    "mlp",
    "resnet",
    "resolve",
    "user_model",
    "vgg",
    "vgg16",
]


def mlp(inputs: int = 64, classes: int = 10, width: int = 128, depth: int = 2) -> nn.Sequential:
    """``depth`` hidden layers of ``width`` with ReLU (depth 2: 5 blocks)."""
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(inputs if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def vgg(channels: int = 1, classes: int = 10, width: int = 16, depth: int = 2, size: int = 8) -> nn.Sequential:
    """VGG-style: ``depth`` groups of two 3x3 convolutions and a 2x2 max-pool, channels doubling, then two
    fully connected layers."""
    layers: list[nn.Module] = []
    c_in = channels
    for g in range(depth):
        c_out = width * 2**g
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.Conv2d(c_out, c_out, 3, padding=1), nn.ReLU()]
        layers.append(nn.MaxPool2d(2))
        c_in, size = c_out, size // 2
    return nn.Sequential(
        *layers, nn.Flatten(), nn.Linear(c_in * size * size, 4 * width), nn.ReLU(), nn.Linear(4 * width, classes)
    )


VGG16_GROUPS = (2, 2, 3, 3, 3)  # convolutions per group in VGG-16 (Simonyan and Zisserman, configuration D)


def vgg16(channels: int = 1, classes: int = 10, width: int = 8, groups: int = 5, size: int = 8) -> nn.Sequential:
    """Shaped like VGG-16 with batch normalization (torchvision's ``vgg16_bn``): images scaled up to 32x32,
    ``groups`` groups of 3x3 convolutions (2, 2, 3, 3, 3 of them), each followed by BatchNorm and ReLU, with
    channels ``width``, ``2 width``, ``4 width``, ``8 width``, ``8 width``, each group ending in a 2x2
    max-pool, then three fully connected layers of ``176 width``, ``176 width`` and ``classes`` outputs. As in
    VGG-16 (89% of its 138M weights), the fully connected layers hold most of the weights (90% of 2.3M at the
    default width): a model whose data parallelism is bound by its all-reduce on a slow network. (Without
    BatchNorm, 13 plain convolutions on the digits stay at chance for 15 epochs with SGD at lr 0.05 or 0.01.)"""
    layers: list[nn.Module] = [] if size == 32 else [nn.Upsample(size=(32, 32), mode="bilinear")]
    c_in, side = channels, 32
    for g, convs in enumerate(VGG16_GROUPS[:groups]):
        c_out = width * min(2**g, 8)
        for _ in range(convs):
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            c_in = c_out
        layers.append(nn.MaxPool2d(2))
        side //= 2
    hidden = 176 * width
    return nn.Sequential(
        *layers,
        nn.Flatten(),
        nn.Linear(c_in * side * side, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a skip connection (a 1x1 projection when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.skip = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.skip(x))


def resnet(channels: int = 1, classes: int = 10, width: int = 16, depth: int = 2) -> nn.Sequential:
    """ResNet-style: a convolution stem, ``depth`` stages of two residual blocks (the first of each later
    stage halves the resolution and doubles the channels), global average pooling, a classifier."""
    layers: list[nn.Module] = [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    c = width
    for g in range(depth):
        c_out = width * 2**g
        layers += [ResidualBlock(c, c_out, 1 if g == 0 else 2), ResidualBlock(c_out, c_out)]
        c = c_out
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes))


class Embedding(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.zeros(context, width))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        embedded: torch.Tensor = self.tokens(ids) + self.positions[: ids.shape[1]]
        return embedded


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.dropout(self.proj(y))
        out: torch.Tensor = x + self.dropout(self.mlp(self.ln2(x)))
        return out


def gpt(
    vocab: int, context: int = 32, *, width: int = 64, depth: int = 4, heads: int = 4, dropout: float = 0.1
) -> nn.Sequential:
    """A GPT-style character model: embeddings, ``depth`` transformer blocks, a final norm and the head."""
    blocks = [TransformerBlock(width, heads, dropout) for _ in range(depth)]
    return nn.Sequential(Embedding(vocab, context, width), *blocks, nn.LayerNorm(width), nn.Linear(width, vocab))


def _inputs(d: Dataset) -> torch.Tensor:
    return d.tensor_inputs("the zoo's models")[0]


def _features(d: Dataset) -> int:
    x = _inputs(d)
    if x.dim() != 2:
        raise InputError(
            f"mlp takes feature vectors (N, F), and {d.name} has inputs of shape {tuple(x.shape)}: use --model resnet "
            "or vgg for images (or leave --model out: it follows the dataset)"
        )
    return x.shape[1]


def _images(d: Dataset) -> tuple[int, int]:
    x = _inputs(d)
    if x.dim() != 4:
        raise InputError(
            f"this model needs images (N, C, H, W), and {d.name} has inputs of shape {tuple(x.shape)}: use --model "
            "mlp for feature vectors (or leave --model out: it follows the dataset)"
        )
    return x.shape[1], x.shape[-1]


# name -> (builder from a dataset, width and depth, the dataset it trains on by default)
MODELS: dict[str, tuple[Callable[[Dataset, int | None, int | None], nn.Sequential], str]] = {
    "mlp": (lambda d, w, n: mlp(_features(d), d.classes, w or 128, n or 2), "digits"),
    "vgg": (lambda d, w, n: vgg(_images(d)[0], d.classes, w or 16, n or 2, _images(d)[1]), "digit-images"),
    "vgg16": (lambda d, w, n: vgg16(_images(d)[0], d.classes, w or 8, min(n or 5, 5), _images(d)[1]), "digit-images"),
    "resnet": (lambda d, w, n: resnet(_images(d)[0], d.classes, w or 16, n or 2), "digit-images"),
    "gpt": (lambda d, w, n: gpt(d.classes, _inputs(d).shape[1], width=w or 64, depth=n or 4), "text"),
    # ResNet-18 for 32x32 images (He et al.'s CIFAR stem: a 3x3 convolution, no max-pool): 4 stages of 2 blocks.
    "resnet18": (lambda d, w, n: resnet(_images(d)[0], d.classes, w or 64, n or 4), "synthetic-images"),
    "gpt2": (
        lambda d, w, n: gpt(
            d.classes, _inputs(d).shape[1], width=w or 768, depth=n or 12, heads=max(1, (w or 768) // 64)
        ),
        "synthetic-text",
    ),
}


def default_dataset(name: str) -> str:
    """The dataset zoo model ``name`` trains on by default; the digits for a ``module:callable``."""
    if ":" in name:
        return "digits"
    if name not in MODELS:
        module, dot, factory = name.rpartition(".")
        hint = f" (a factory is named with a colon: {module}:{factory})" if dot else ""
        raise InputError(
            f"unknown model {name!r}: use one of {', '.join(sorted(MODELS))}, or package.module:factory{hint}"
        )
    return MODELS[name][1]


def build(name: str, dataset: Dataset, width: int | None = None, depth: int | None = None) -> nn.Sequential:
    """Build zoo model ``name`` for ``dataset`` (its input shape and classes), optionally resized.

    Raises:
        ValueError: an unknown name, or a dataset the model cannot take.
    """
    default_dataset(name)  # an unknown name fails here
    if name in ("gpt", "gpt2") and not dataset.sequence:
        raise InputError(
            f"{name} is a language model: train it on a text dataset (text, text:PATH, synthetic-text), not "
            f"{dataset.name}"
        )
    if name not in ("gpt", "gpt2") and dataset.sequence:
        raise InputError(f"{name} classifies samples; {dataset.name} is text: use gpt for it")
    return MODELS[name][0](dataset, width, depth)


def resolve(spec: str, batch_size: int, data: Dataset | None = None, args: str = "") -> tuple[nn.Sequential, Any]:
    """A model as blocks, and an example batch, for ``spec``: a zoo name (on ``data``, default its own dataset) or
    ``module:callable`` (see the module docstring), given ``args`` (``--model-args``); ``data`` gives the example
    batch of a callable that returns the model alone (default: the digits).

    Raises:
        InputError: the name is unknown, the callable cannot be imported, does not take ``args``, returns
            something else, or returns a module ``torch.export`` cannot trace.
    """
    if ":" not in spec:
        data = data or load(default_dataset(spec))
        return build(spec, data), rows(data.train_x, slice(batch_size))
    model, example = user_model(spec, batch_size, data, args)
    if isinstance(model, list):
        return nn.Sequential(*model), example
    if isinstance(model, nn.Sequential):
        return model, example
    return _split(spec, model, example, data), example


def user_model(spec: str, batch_size: int, data: Dataset | None = None, args: str = "") -> tuple[Any, Any]:
    """What ``module:callable`` gives, as it gives it (not split): the model (a module or a list of blocks) and an
    example batch (from ``data``, default the digits, when the callable returns the model alone).

    Raises:
        InputError: the callable cannot be imported, does not take ``args`` or returns something else.
    """
    result = _call(spec, load_factory(spec), batch_size, model_arguments(args))
    if isinstance(result, nn.Module):
        result = (result, rows((data or load("digits")).train_x, slice(batch_size)))
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module | list)):
        raise InputError(
            f"the factory {spec!r} returned {type(result).__name__}: it must return (model, example_batch) "
            "for the batch size it is given, or the model"
        )
    return result


def _call(spec: str, make: Callable[..., Any], batch_size: int, kwargs: dict[str, Any]) -> Any:
    """A Hugging Face model class is given its configuration made from ``kwargs``; a callable with a parameter
    named ``batch_size`` is given it; any other is called with ``kwargs`` alone if it takes them so, else with
    the batch size first (a ``factory(n)``).

    Raises:
        InputError: it takes none of these (errors raised inside it are its own, and keep their traceback).
    """
    config_class = getattr(make, "config_class", None)
    if isinstance(make, type) and config_class is not None:
        try:
            config = config_class(**{"use_cache": False, **kwargs})  # (a cache of keys and values is for inference)
        except TypeError as exc:
            raise InputError(f"--model {spec}: its configuration does not take --model-args {kwargs}: {exc}") from None
        return make(config)
    try:
        signature = inspect.signature(make)
    except (TypeError, ValueError):  # a callable without a signature Python can read: as it is given
        return make(**kwargs)
    has_batch = "batch_size" in signature.parameters
    attempts = [((), {"batch_size": batch_size, **kwargs})] if has_batch else [((), kwargs), ((batch_size,), kwargs)]
    for args, named in attempts:
        try:
            signature.bind(*args, **named)
        except TypeError:
            continue
        return make(*args, **named)
    raise InputError(f"--model {spec} cannot be called with --model-args {kwargs}: it takes {signature}")


def _split(spec: str, model: nn.Module, example: Any, data: Dataset | None) -> nn.Sequential:
    """``model`` split into blocks, checked against ``data`` where given (its classes; on text, that it does not
    see the tokens it predicts); a model that returns a mapping gets a last block that takes its logits."""
    blocks = split_model(model, example)
    last = blocks[-1]
    assert isinstance(last, GraphBlock)
    if is_mapping(last.output_spec):
        if "logits" not in last.output_spec.context:
            raise InputError(f"the model of {spec!r} returns a mapping without logits: return the logits")
        blocks.add_module("logits", Logits())
    if data is not None:
        check_classes(spec, blocks, data)
        check_causal(spec, blocks, example, data)
    return blocks


class Logits(nn.Module):
    """The ``logits`` of a model's output mapping (a Hugging Face ``ModelOutput``): what the loss takes."""

    def forward(self, output: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return output["logits"]


def load_factory(spec: str) -> Callable[[int], Any]:
    """Import ``package.module:factory``, from the installed packages or else, as ``python -m`` would, from the
    current folder (the ``conveyor`` script's own folder is what Python puts first on its path)."""
    module_name, _, attr = spec.partition(":")
    try:
        factory: Callable[[int], Any] = getattr(_import_here_too(module_name), attr)
        return factory
    except (ImportError, AttributeError) as exc:
        raise InputError(f"cannot load the model factory {spec!r}: {exc}") from exc


def _import_here_too(module_name: str) -> Any:
    """The module, looked for on the path and then in the current folder (appended, so that a file there never
    hides an installed package of the same name)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        here = os.getcwd()
        missing = exc.name or ""  # a part of the name (a namespace package elsewhere may hold its first part)
        if not (module_name == missing or module_name.startswith(missing + ".")) or here in sys.path:
            raise
        sys.path.append(here)
        return importlib.import_module(module_name)
