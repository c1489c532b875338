"""Weight versions of one stage: the stash that lets asynchronous schedules update weights mid-flight.

PipeDream and PipeDream-2BW update a stage's weights while microbatches that ran their forward on the
old weights still wait for their backward, and that backward must use the same weights as its forward.
Updating a parameter in place under a live autograd graph is exactly what broke the original PipeDream
on PyTorch >= 1.5, so here every version is a separate set of tensors that is never modified: a
forward runs the stage with ``torch.func.functional_call`` on its version's tensors, its graph keeps
them, and an optimizer step writes a *new* version. The optimizer owns the module's own parameters (the
master copy); a version is a clone of them made after each step.

A schedule that never updates weights under an in-flight microbatch (GPipe, PipeDream-Flush) needs no
stash: the module runs directly and nothing is copied.

Example:
    >>> from conveyor.schedule._schedule import pipedream
    >>> stage = WeightVersions(torch.nn.Linear(2, 2))
    >>> stage.start(pipedream(stages=3, microbatches=6), worker=0)
    >>> stage.stashing
    True
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from conveyor.schedule._schedule import Schedule

__all__ = ["StashError", "WeightVersions"]


class StashError(RuntimeError):
    """A microbatch's backward would not use the weights its forward used."""


class WeightVersions:
    """The weight versions a stage keeps for the microbatches in flight, freed as soon as none needs them.

    Args:
        module: the stage; its parameters are the master copy the optimizer updates.
        debug: keep a copy of each microbatch's weights at its forward and check at its backward that
            they are unchanged (costs one copy of the stage's weights per microbatch in flight).
    """

    def __init__(self, module: nn.Module, debug: bool = False) -> None:
        self.module = module
        self.debug = debug
        self.stashing = False
        self.peak = 1
        self._versions: dict[int, dict[str, torch.Tensor]] = {}
        self._uses: dict[int, int] = {}
        self._need: Counter[int] = Counter()
        self._newest = 0
        self._snapshots: dict[int, list[torch.Tensor]] = {}

    def start(self, schedule: Schedule, worker: int) -> None:
        """Prepare for a run of ``schedule``: version 0 is the module's current weights."""
        self._uses = schedule.forward_versions(worker)
        self._need = Counter(self._uses.values())
        self._newest = 0
        self._snapshots = {}
        self.stashing = schedule.worker_peak_versions(worker) > 1
        self._versions = {0: self._clone()} if self.stashing else {}

    @property
    def live(self) -> int:
        """How many versions are held now (1 without stashing)."""
        return max(len(self._versions), 1)

    def forward(self, microbatch: int, inputs: Any) -> Any:
        """Run the stage on ``inputs`` with the weights the schedule assigns to ``microbatch``."""
        if not self.stashing:
            return self.module(inputs)
        weights = self._versions[self._uses[microbatch]]
        if self.debug:
            self._snapshots[microbatch] = [t.detach().clone() for t in weights.values()]
        return functional_call(self.module, weights, (inputs,))

    def check(self, microbatch: int, stage: int) -> None:
        """In debug mode, raise :class:`StashError` if ``microbatch``'s weights changed since its forward."""
        if not self.debug or not self.stashing:
            return
        v = self._uses[microbatch]
        now = self._versions.get(v)
        before = self._snapshots.pop(microbatch)
        if now is None or not all(torch.equal(a, b) for a, b in zip(now.values(), before, strict=True)):
            raise StashError(
                f"stage {stage}: the backward of microbatch {microbatch} would use weights other than version {v}, "
                "which its forward used: the weight stash was modified or freed while the microbatch was in flight"
            )

    def done(self, microbatch: int) -> None:
        """The backward of ``microbatch`` ran: free its version if nothing else needs it."""
        v = self._uses[microbatch]
        self._need[v] -= 1
        if self._need[v] == 0 and v != self._newest:
            self._release(v)

    def collect_grads(self) -> None:
        """Move the gradients accumulated on the versions onto the master parameters, for the optimizer."""
        for weights in self._versions.values():
            self._move_grads(weights)

    def _move_grads(self, weights: dict[str, torch.Tensor]) -> None:
        params = dict(self.module.named_parameters())
        for name, t in weights.items():
            if t.grad is not None:
                p = params[name]
                p.grad = t.grad if p.grad is None else p.grad + t.grad
                t.grad = None

    def _release(self, version: int) -> None:
        """Free ``version``, keeping the gradients it holds for the next step."""
        weights = self._versions.pop(version, None)
        if weights is not None:
            self._move_grads(weights)

    def publish(self) -> None:
        """The optimizer stepped the master parameters: make them the newest version."""
        old = self._newest
        self._newest += 1
        if not self.stashing:
            return
        self._versions[self._newest] = self._clone()
        if self._need[old] == 0:
            self._release(old)
        self.peak = max(self.peak, len(self._versions))

    def _clone(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {
                name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in self.module.named_parameters()
            }
