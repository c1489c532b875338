"""Whether a user's model fits its data, checked before any worker starts: the classes it scores against the
data's (more is a padded vocabulary, noted; fewer is refused), and, on a next-token dataset, that it does not see
the tokens it is to predict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from conveyor.errors import InputError
from conveyor.job._data import Dataset
from conveyor.runtime import GraphBlock

__all__ = ["check_causal", "check_classes", "is_mapping", "scored_classes"]


def is_mapping(spec: Any) -> bool:
    """Whether a traced output's pytree spec is a mapping (a Hugging Face ``ModelOutput``)."""
    return spec is not None and isinstance(spec.type, type) and issubclass(spec.type, Mapping)


def scored_classes(model: nn.Sequential) -> int | None:
    """The classes a split model scores: its last graph block's logits' last dimension, from the traced shapes
    (nothing runs); ``None`` for a model that was not split."""
    last = next((b for b in reversed(list(model)) if isinstance(b, GraphBlock)), None)
    if last is None:
        return None
    values, spec = last.traced_outputs(), last.output_spec
    if is_mapping(spec) and "logits" in spec.context:
        values = [values[list(spec.context).index("logits")]]
    scores = [v.shape[-1] for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2]
    return int(scores[0]) if scores else None


def check_classes(spec: str, model: nn.Sequential, data: Dataset) -> None:
    """Refuse a split model that scores fewer classes than ``data`` has (more train: the extra ones are never a
    target, as a vocabulary padded to a multiple of 64 is).

    Raises:
        InputError: too few outputs (one line, with the option that sets them).
    """
    scores = scored_classes(model)
    if scores is not None and scores < data.classes:
        raise InputError(
            f"--model {spec} scores {scores} classes but {data.name} has {data.classes}: give the model "
            f"{data.classes} outputs or more (--model-args num_classes={data.classes}, or vocab_size= for a language "
            "model)"
        )


def check_causal(spec: str, model: nn.Sequential, example: Any, data: Dataset) -> None:
    """On a next-token dataset, refuse a model whose outputs before the last position change when the last token
    does (a bidirectional model would learn to copy the target it sees): one forward of two rows, and one with
    their last token changed, in evaluation mode. A model on the meta device is not run.

    Raises:
        InputError: the model sees later tokens (one line).
    """
    tokens = example.get("input_ids") if isinstance(example, dict) else example
    if not data.sequence or not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] < 2:
        return
    if isinstance(example, dict) and "labels" in example:  # sequence to sequence: the targets are not the input
        return
    if any(p.is_meta for p in model.parameters()):
        return
    rows = {k: v[:2] for k, v in example.items()} if isinstance(example, dict) else example[:2]
    changed_tokens = tokens[:2].clone()
    changed_tokens[:, -1] = (changed_tokens[:, -1] + 1) % data.classes
    changed = {**rows, "input_ids": changed_tokens} if isinstance(rows, dict) else changed_tokens
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            before, after = model(rows), model(changed)
    finally:
        model.train(was_training)
    if not torch.allclose(before[:, :-1], after[:, :-1]):
        raise InputError(
            f"--model {spec} sees later tokens (its outputs at earlier positions changed with the last token), and "
            f"{data.name} asks for each next token: give a causal model (a decoder, e.g. a ...ForCausalLM class)"
        )
