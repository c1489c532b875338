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

**Weight prediction** (the stale-gradient correction, as in SpecTrain and PipeMare). A stage whose
gradients are ``d`` updates stale (:meth:`~conveyor.schedule.Kind.staleness`) can publish, instead of the
weights ``W(v)`` its step made, a guess at the weights the gradient will be applied to, extrapolating the
step just made:

    What(v) = W(v) + d (W(v) - W(v-1))        (What(0) = W(0), the weights a run starts from)

The forward and the backward of a microbatch both run on ``What(v)`` (so weight stashing still holds), and
the gradient they give is applied to the master weights: ``W(t+1) = step(W(t), grad f(What(t-d)))``. With
SGD and momentum ``beta`` (no dampening), ``W(v) - W(v-1) = -lr u(v)`` for the momentum buffer ``u``, so
``What(v) = W(v) - d lr u(v)``: SpecTrain's prediction from the smoothed gradient. The step keeps a copy of
the master weights only until the version is made.

Example:
    >>> stage = WeightVersions(torch.nn.Linear(2, 2))
    >>> stage.start(stashing=True)
    >>> y = stage.forward(0, torch.ones(1, 2))  # microbatch 0 on version 0
    >>> stage.collect_grads(); stage.publish()   # a step: version 1 is the newest, 0 stays for microbatch 0
    >>> stage.live
    2
    >>> stage.done(0); stage.live                # microbatch 0's backward ran: version 0 is freed
    1
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

__all__ = ["StashError", "WeightVersions"]


class StashError(RuntimeError):
    """A microbatch's backward would not use the weights its forward used."""


class WeightVersions:
    """The weight versions a stage keeps for the microbatches in flight, freed as soon as none needs them.

    A version lives from the step that makes it until it is neither the newest, nor used by a microbatch
    whose backward is pending, nor pinned by a forward still to come (2BW and vertical sync name the
    version each forward uses; ask ``will_use``), the rule
    :meth:`~conveyor.schedule.Schedule.worker_peak_versions` applies to a whole action list.

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
        self._will_use: Callable[[int], bool] = _never
        self.last_forward = -1  # the latest microbatch a version was held for
        self.predict = 0  # the staleness d a version is extrapolated over (0: no prediction)
        self._before_step: list[torch.Tensor] | None = None

    def start(self, stashing: bool, will_use: Callable[[int], bool] | None = None, predict: int = 0) -> None:
        """Prepare for a run: version 0 is the module's current weights.

        Args:
            stashing: keep versions for the backwards of microbatches in flight (without it the module runs
                as is: a flush schedule).
            will_use: whether a forward not yet run will ask for this version (``None``: forwards always
                use the newest).
            predict: publish each new version extrapolated over this many steps (see the module's
                docstring); 0 publishes the weights as they are. Only with ``stashing``.
        """
        self._uses, self._need, self._newest, self._snapshots = {}, Counter(), 0, {}
        self.stashing, self.last_forward = stashing, -1
        self.predict, self._before_step = (predict if stashing else 0), None
        self._will_use = will_use or _never
        self._versions = {0: self._clone()} if stashing else {}

    @property
    def live(self) -> int:
        """How many versions are held now (1 without stashing)."""
        return max(len(self._versions), 1)

    def use(self, microbatch: int, version: int | None = None) -> int:
        """Hold ``version`` (default the newest) for ``microbatch`` until its backward; return it. Its forward
        calls this; an empty microbatch, which runs nothing, calls it alone."""
        if microbatch not in self._uses:
            v = self._newest if version is None else version
            self._uses[microbatch] = v
            self._need[v] += 1
            self.last_forward = max(self.last_forward, microbatch)
        return self._uses[microbatch]

    def forward(self, microbatch: int, inputs: Any, version: int | None = None) -> Any:
        """Run the stage on ``inputs`` with weight ``version`` (default the newest), held for ``microbatch``."""
        v = self.use(microbatch, version)
        if not self.stashing:
            return self.module(inputs)
        weights = self._versions[v]
        if self.debug:
            self._snapshots[microbatch] = [t.detach().clone() for t in weights.values()]
        return functional_call(self.module, weights, (inputs,))

    def check(self, microbatch: int, stage: int) -> None:
        """In debug mode, raise :class:`StashError` if ``microbatch``'s weights changed since its forward."""
        if not self.debug or not self.stashing:
            return
        v = self._uses[microbatch]
        now = self._versions.get(v)
        before = self._snapshots.pop(microbatch, None)
        if before is None:  # an empty microbatch: nothing ran
            return
        if now is None or not all(torch.equal(a, b) for a, b in zip(now.values(), before, strict=True)):
            raise StashError(
                f"stage {stage}: the backward of microbatch {microbatch} would use weights other than version {v}, "
                "which its forward used: the weight stash was modified or freed while the microbatch was in flight"
            )

    def done(self, microbatch: int) -> None:
        """The backward of ``microbatch`` ran: free its version if nothing else needs it."""
        v = self._uses.pop(microbatch)
        self._snapshots.pop(microbatch, None)  # one a recomputed forward took again
        self._need[v] -= 1
        self._free_if_unused(v)

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

    def _free_if_unused(self, version: int) -> None:
        """Free ``version``, keeping the gradients it holds for the next step, unless something needs it."""
        if self._need[version] or version == self._newest or version not in self._versions:
            return
        if self._will_use(version):
            return
        self._move_grads(self._versions.pop(version))

    def before_step(self) -> None:
        """The optimizer is about to step: with prediction, keep the master weights ``W(v-1)`` until
        :meth:`publish`."""
        if self.predict:
            self._before_step = [p.detach().clone() for p in self.module.parameters()]

    def publish(self) -> None:
        """The optimizer stepped the master parameters: make them (or, with prediction, their extrapolation)
        the newest version."""
        old = self._newest
        self._newest += 1
        if not self.stashing:
            return
        self._versions[self._newest] = self._clone()
        if self._before_step is not None:
            with torch.no_grad():
                for t, before in zip(self._versions[self._newest].values(), self._before_step, strict=True):
                    t.add_(t - before, alpha=self.predict)  # What = W + d (W - W_before)
            self._before_step = None
        self._free_if_unused(old)  # one kept for a coming forward goes when that forward's backward is done
        self.peak = max(self.peak, len(self._versions))

    def _clone(self) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {
                name: p.detach().clone().requires_grad_(p.requires_grad) for name, p in self.module.named_parameters()
            }


def _never(version: int) -> bool:
    return False
