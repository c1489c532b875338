"""One worker alone: each batch's microbatches forward and backward in turn, and the updates, with no schedule.

A pipeline of one stage on one worker keeps no weight versions (nothing is in flight between a microbatch's
forward and its backward but that microbatch), so every schedule but 2BW's runs each microbatch on the newest
weights. For a batch of ``N`` samples cut into microbatches ``k`` of ``n_k`` samples and mean loss ``l_k``, the
synchronous schedules (``flush``, ``gpipe``) make one update, gradient accumulation over the batch,

    W <- step(W, sum over k of (n_k / N) grad l_k(W))

and PipeDream's (``pipedream``, ``pipedream-vs``: every microbatch a minibatch) one update per microbatch,

    W <- step(W, (n_k grad l_k(W)) / n_k)

(an empty microbatch steps nothing). The executor gets them from the schedule's action list (``F0 B0 F1 B1 ...
REDUCE STEP``, or ``F0 B0 REDUCE STEP F1 ...``; ``gpipe`` runs its forwards first and its backwards in the same
order, so the sums are the same); this loop does those actions' work in that order with the same
:class:`~conveyor.runtime._update.Updater`, so the weights come out equal bit for bit
(``tests/runtime/test_solo.py``). What it leaves out is what only a worker among others needs: the action stream
and its lookahead, the feed's read-ahead and length announcements, the weight versions and the receive
prefetcher. On a small model that generality is most of a step's cost above a plain PyTorch loop: on the MLP of
``conveyor train`` (2 CPU cores, 23 batches of 64 an epoch, medians of 59 epochs in one process) an epoch took
17.96 ms through the executor, 15.31 ms in this loop's first form and 14.98 ms in a plain loop.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from conveyor.runtime._executor import LossFn, RunOutput
from conveyor.runtime._feed import cut_batch
from conveyor.runtime._microbatch import to_device
from conveyor.runtime._update import OptimizerFactory, Updater

__all__ = ["Alone", "lone_updater"]


def lone_updater(
    module: nn.Module, optimizer: OptimizerFactory, device: torch.device, *, averaged: bool = True
) -> Updater:
    """The updater of a whole model on one worker, with an optimizer of its own, without clipping: ``averaged``,
    the backwards already sum to the mean gradient (an update per batch); else the update divides their sum by its
    samples (an update per microbatch, PipeDream's)."""
    params = list(module.parameters())
    return Updater(
        module,
        optimizer(params) if params else None,
        group=None,
        max_grad_norm=None,
        clip_whole_model=False,
        replicas=1,
        device=device,
        averaged=averaged,
    )


class Alone:
    """Trains a whole model on one worker: each batch's microbatches in turn, and the updates.

    Args:
        module: the whole model, on ``device``.
        microbatches: the parts each batch is cut into (as the pipeline's).
        loss_fn: ``loss_fn(output, target)``, the mean over a microbatch's samples.
        updater: the model's updater, without replicas: ``averaged`` for one update per batch, not for one per
            microbatch.
        device: where inputs and targets are moved.
        per_microbatch: one update per microbatch (PipeDream's), not per batch.
        autocast: run forwards and the loss under ``torch.autocast`` with this dtype.
        recompute: keep only each microbatch's input and re-run its forward in the backward.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        microbatches: int,
        loss_fn: LossFn,
        updater: Updater,
        device: torch.device,
        per_microbatch: bool = False,
        autocast: torch.dtype | None = None,
        recompute: bool = False,
    ) -> None:
        if updater.averaged == per_microbatch or updater.group is not None:
            raise ValueError(
                "one worker alone needs an updater without replicas, averaged for one update per batch and not "
                "for one per microbatch"
            )
        self.module, self.microbatches, self.loss_fn, self.updater = module, microbatches, loss_fn, updater
        self.device, self.per_microbatch, self.autocast, self.recompute = device, per_microbatch, autocast, recompute
        self.peak_stashed = 0  # microbatches held for a pending backward: one at a time

    @classmethod
    def of_copy(
        cls,
        model: nn.Module,
        *,
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        device: torch.device,
        autocast: torch.dtype | None = None,
    ) -> Alone:
        """One worker alone on a copy of ``model`` (on ``device``, with an optimizer of its own), a microbatch a batch:
        what the start-up measurements time (``conveyor.job._measure``)."""
        module = copy.deepcopy(model).to(device)
        updater = lone_updater(module, optimizer, device)
        return cls(module, microbatches=1, loss_fn=loss_fn, updater=updater, device=device, autocast=autocast)

    def run(self, batches: Iterable[Any], on_step: Callable[[], None] | None = None) -> tuple[RunOutput, int]:
        """Train on every ``(inputs, targets)`` batch; each microbatch's loss, and the batches trained on."""
        out, count, m = RunOutput(), 0, self.microbatches
        with torch.enable_grad():  # once a run: a context entered per microbatch costs a small model's step 2%
            for count, item in enumerate(batches, start=1):
                inputs, targets, sizes = cut_batch(item, m, inputs=True, targets=True, worker=0, index=count - 1)
                assert inputs is not None and targets is not None
                total = sum(sizes)
                for i, samples in enumerate(sizes):
                    if samples:  # a batch of fewer samples than microbatches leaves the last parts empty
                        scale = samples if self.per_microbatch else samples / total  # as the executor's root
                        loss = self._forward_backward(inputs[i], targets[i], scale)
                        out.losses[(count - 1) * m + i] = (loss, samples)
                    if self.per_microbatch:
                        self._update(samples, on_step)
                if not self.per_microbatch:
                    self._update(total, on_step)
        return out, count

    def _update(self, samples: int, on_step: Callable[[], None] | None) -> None:
        self.updater.reduce(samples)
        self.updater.step()
        if on_step is not None:
            on_step()

    def _forward_backward(self, inputs: Any, targets: Any, scale: float) -> torch.Tensor:
        """One microbatch's forward and its backward from its loss times ``scale`` (the executor's
        ``_backward_root``: the batch's share ``n / N``, or the sum ``n`` that the update divides); its loss,
        detached."""
        with torch.autocast(self.device.type, self.autocast) if self.autocast else contextlib.nullcontext():
            if self.recompute:
                outputs = checkpoint(self.module, to_device(inputs, self.device), use_reentrant=False)
            else:
                outputs = self.module(to_device(inputs, self.device))
            loss = self.loss_fn(outputs, to_device(targets, self.device))
            root = loss if scale == 1 else loss * scale
        self.peak_stashed = 1
        torch.autograd.backward(root)
        return loss.detach()
