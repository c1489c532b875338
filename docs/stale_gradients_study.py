"""The single-process study behind Conveyor's stale-gradient correction (docs/concepts/stale-gradients.md).

Every update applies a gradient ``d`` updates stale, ``W(t+1) = step(W(t), grad f(W'(t - d)))``, on a zoo
model and its bundled data, with ``conveyor train``'s default optimizer (SGD, lr 0.05, momentum 0.9), and
prints the epochs each method needs to a target test accuracy, per seed. ``W'`` is what the method
evaluates the gradient on:

- ``none``: ``W' = W`` (the plain schedules);
- ``predict``: ``W'(v) = W(v) + d (W(v) - W(v-1))`` (weight prediction, as Conveyor does);
- ``warmup``: ``W' = W``, the learning rate ramped up linearly over the first 2 epochs (PipeMare's);
- ``predict+warmup``: both;
- ``momentum 0.5``: ``W' = W``, momentum 0.5 instead of 0.9;
- ``half lr``: ``W' = W``, half the learning rate;
- ``dc``: ``W' = W``, delay compensation (DC-ASGD, lambda 1): ``g + g * g * (W(t) - W(t - d))``.

``--per`` samples per update (64: one per batch, as 2BW with delay 1; 16: one per microbatch, as a 4-stage
PipeDream, whose first stage has delay 3; ``--scale-lr`` then gives each update ``lr * per / 64``).

Run: ``python docs/stale_gradients_study.py vgg --delay 1`` (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.func import functional_call

from conveyor.job._data import load
from conveyor.job._zoo import build, default_dataset

METHODS = ("sync", "none", "predict", "warmup", "predict+warmup", "momentum 0.5", "half lr", "dc")


def accuracy_curve(model: str, method: str, delay: int, per: int, lr: float, epochs: int, seed: int) -> list[float]:
    """Test accuracy after each epoch of training ``model`` with ``method`` (``sync``: no delay at all)."""
    torch.manual_seed(seed)
    data = load(default_dataset(model))
    net = build(model, data)
    delay = 0 if method == "sync" else delay
    optimizer = torch.optim.SGD(net.parameters(), lr=lr / (2 if method == "half lr" else 1),
                                momentum=0.5 if method == "momentum 0.5" else 0.9)  # fmt: skip
    warmup = 2 * -(-len(data.train_x) // per) if "warmup" in method else 0
    history = [{n: p.detach().clone() for n, p in net.named_parameters()}]  # W(0), W(1), ...
    order_seed, accuracies, steps = torch.Generator().manual_seed(seed), [], 0
    for _ in range(epochs):
        order = torch.randperm(len(data.train_x), generator=order_seed)
        for i in range(0, len(order), per):
            x, y = data.train_x[order[i : i + per]], data.train_y[order[i : i + per]]
            v = max(0, len(history) - 1 - delay)  # the version the gradient is computed on
            weights = history[v]
            if "predict" in method and v > 0:
                weights = {n: w + delay * (w - history[v - 1][n]) for n, w in weights.items()}
            leaves = {n: w.clone().requires_grad_() for n, w in weights.items()}
            out = functional_call(net, leaves, (x,))
            F.cross_entropy(out.flatten(0, -2), y.flatten()).backward()
            for n, p in net.named_parameters():
                g = leaves[n].grad
                p.grad = g + g * g * (p.detach() - history[v][n]) if method == "dc" else g
            for group in optimizer.param_groups:
                group["lr"] = optimizer.defaults["lr"] * (min(1.0, (steps + 1) / warmup) if warmup else 1.0)
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            history.append({n: p.detach().clone() for n, p in net.named_parameters()})
            if len(history) >= delay + 3:  # only the last d + 2 versions are read again
                history[len(history) - delay - 3] = {}
        with torch.no_grad():
            accuracies.append(float((net(data.test_x).argmax(-1) == data.test_y).float().mean()))
    return accuracies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", choices=["mlp", "vgg", "resnet", "gpt"])
    parser.add_argument("--delay", type=int, default=1)
    parser.add_argument("--per", type=int, default=64, help="samples per update")
    parser.add_argument("--scale-lr", action="store_true", help="lr * per / 64 for every update")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    lr = 0.05 * (args.per / 64 if args.scale_lr else 1)
    for method in args.methods.split(","):
        epochs = []
        for seed in range(args.seeds):
            curve = accuracy_curve(args.model, method, args.delay, args.per, lr, args.epochs, seed)
            epochs.append(next((str(i + 1) for i, a in enumerate(curve) if a >= args.target), "-"))
        print(f"{args.model} delay {args.delay} per {args.per} lr {lr:g} {method:>15}: epochs to {args.target:g} "
              f"per seed {' '.join(epochs)} (final {curve[-1]:.3f} on the last seed)", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
