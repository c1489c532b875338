"""Single-process references for every schedule's weight-update semantics, written from their equations.

Microbatch ``k`` is part ``k % m`` of batch ``k // m`` (parts as equal as possible, maybe empty). Stage
``s`` (with ``r_s`` replicas) runs it on the weight version ``version(s, k)`` and folds its gradient into
update ``update(s, k)``; an update's gradient is the mean over the samples it covers,
``sum n_k g_k / sum n_k`` with ``g_k`` the gradient of microbatch ``k``'s mean loss, and an update without
samples leaves the weights as they are (but still makes a version). The equations, per schedule:

- gpipe, flush: ``version = k // m`` and one update per batch (gradient accumulation).
- pipedream: a replica of stage ``s`` admits ``w_s = ceil(sum(r[s:]) / r_s)`` minibatches before its first
  backward and then alternates, so ``version = max(0, k // r_s - w_s + 1)``; one update per round of
  ``r_s`` minibatches. Unreplicated: ``W(t+1)`` uses the gradient at ``W(t - (p - 1 - s))``.
- pipedream-vs: the input stage's version ``u`` of that formula, on every stage ``floor(u * r_0 / r_s)``.
- 2bw: ``version = max(0, k // m - 1)`` and one update per batch: ``W(t+1) = W(t) - lr * grad f(W(t-1))``.

With ``correct=True`` (the stale-gradient correction) an asynchronous stage ``s`` with staleness ``d_s``
(updates between the version a gradient is computed on and the update applying it: ``w_s - 1`` for
pipedream, 1 for 2bw, the most of ``k // r_s - version(s, k)`` for pipedream-vs) runs version ``v`` on the
prediction ``W(v) + d_s (W(v) - W(v-1))`` (``W(0)`` for ``v = 0``), and pipedream's optimizers get the
learning rate times ``r_s / m``; with ``damped=True`` as well every asynchronous stage's rate is divided by
``1 + d_s``.
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call


def _versions(name: str, replicas: Sequence[int], m: int) -> Callable[[int, int], int]:
    def warmup(s: int) -> int:
        return math.ceil(sum(replicas[s:]) / replicas[s])

    def pipedream(s: int, k: int) -> int:
        return max(0, k // replicas[s] - warmup(s) + 1)

    return {
        "gpipe": lambda s, k: k // m,
        "flush": lambda s, k: k // m,
        "pipedream": pipedream,
        "pipedream-vs": lambda s, k: pipedream(0, k) * replicas[0] // replicas[s],
        "2bw": lambda s, k: max(0, k // m - 1),
    }[name]


def train(
    stages: Sequence[nn.Module],
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    microbatches: int,
    schedule: str,
    replicas: Sequence[int],
    optimizer: Callable[..., torch.optim.Optimizer],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    max_grad_norm: float | None = None,
    autocast: torch.dtype | None = None,
    correct: bool = False,
    damped: bool = False,
) -> None:
    """Train ``stages`` in place on ``batches`` with ``schedule``'s semantics.

    ``max_grad_norm`` clips the whole model's gradient for gpipe and flush, each stage's own for the
    asynchronous schedules (their stages step at different times).
    """
    m = microbatches
    version = _versions(schedule, replicas, m)

    def update(s: int, k: int) -> int:
        return k // replicas[s] if schedule.startswith("pipedream") else k // m

    opts = [optimizer(st.parameters()) if list(st.parameters()) else None for st in stages]
    stale = [_staleness(schedule, replicas, s) if correct else 0 for s in range(len(stages))]
    for s, opt in enumerate(opts):
        for group in opt.param_groups if opt is not None and correct and schedule.startswith("pipedream") else []:
            group["lr"] *= replicas[s] / m
        for group in opt.param_groups if opt is not None and correct and damped else []:
            group["lr"] /= 1 + stale[s]

    def weights_of(s: int, v: int) -> dict[str, torch.Tensor]:
        w = history[s][v]
        if stale[s] and v > 0:
            return {n: t + stale[s] * (t - history[s][v - 1][n]) for n, t in w.items()}
        return w

    history = [[_snapshot(st)] for st in stages]
    pending: list[list[tuple[int, dict[str, torch.Tensor]]]] = [[] for _ in stages]
    micro = [(x, y) for xb, yb in batches for x, y in zip(xb.tensor_split(m), yb.tensor_split(m), strict=True)]
    for k, (x, y) in enumerate(micro):
        weights = [
            {n: t.clone().requires_grad_() for n, t in weights_of(s, version(s, k)).items()} for s in range(len(stages))
        ]
        if len(x):
            with torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None):
                h = x
                for s, st in enumerate(stages):
                    h = functional_call(st, weights[s], (h,))
                loss = loss_fn(h, y)
            loss.backward()
        updating = []
        for s in range(len(stages)):
            pending[s].append((len(x), {n: t.grad for n, t in weights[s].items()}))
            if k + 1 == len(micro) or update(s, k + 1) != update(s, k):
                updating.append(s)
        for s in updating:
            samples = sum(n for n, _ in pending[s])
            for name, p in stages[s].named_parameters():
                p.grad = sum(g[name] * n for n, g in pending[s] if n) / samples if samples else None
        if max_grad_norm is not None and schedule in ("gpipe", "flush"):
            torch.nn.utils.clip_grad_norm_([p for s in updating for p in stages[s].parameters()], max_grad_norm)
        elif max_grad_norm is not None:
            for s in updating:
                torch.nn.utils.clip_grad_norm_(stages[s].parameters(), max_grad_norm)
        for s in updating:
            if opts[s] is not None and sum(n for n, _ in pending[s]):
                opts[s].step()
                opts[s].zero_grad(set_to_none=True)
            pending[s] = []
            history[s].append(_snapshot(stages[s]))


def _staleness(schedule: str, replicas: Sequence[int], s: int) -> int:
    def warmup(s: int) -> int:
        return math.ceil(sum(replicas[s:]) / replicas[s])

    if schedule == "pipedream":
        return warmup(s) - 1
    if schedule == "pipedream-vs":
        version = _versions(schedule, replicas, 1)
        return max(k // replicas[s] - version(s, k) for k in range(1000, 1000 + replicas[0] * replicas[s]))
    return 1 if schedule == "2bw" else 0


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}
