"""Small models for the pipeline tests: plain blocks, parameter-less blocks, tuples and dicts between stages."""

import copy
import functools

import torch
from torch import nn


def mlp() -> nn.Sequential:
    """Five blocks, two of them without parameters (a 4-stage split [1, 1, 2, 1] gives a stage none)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


class Fork(nn.Module):
    """x -> (relu(W x), x): a tuple whose second element skips ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.lin(x)), x


class Mix(nn.Module):
    """(h, x) -> a dict with a float tensor, an integer tensor and a plain value."""

    def __init__(self) -> None:
        super().__init__()
        self.skip = nn.Linear(8, 16)

    def forward(self, hx: tuple[torch.Tensor, torch.Tensor]) -> dict[str, object]:
        h, x = hx
        return {"h": h + self.skip(x), "ids": h.argmax(dim=1) % 5, "scale": 0.5}


class Embed(nn.Module):
    """dict -> (h, ids): uses the integer tensor and the plain value that crossed a stage boundary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 16)

    def forward(self, d: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(d["h"] * d["scale"] + self.emb(d["ids"])), d["ids"]


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)

    def forward(self, h_ids: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(h_ids[0])


def branchy() -> nn.Sequential:
    """Four blocks that pass a tuple, a dict and a tuple with an integer tensor between them."""
    torch.manual_seed(0)
    return nn.Sequential(Fork(), Mix(), Embed(), Head())


class Tangle(nn.Module):
    """A user's module, not blocks: a skip from the first layer to the last, and l1's weight used again by
    ``tied`` two layers later (as tied embeddings are)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.tied, self.head = nn.Linear(16, 16), nn.Linear(16, 4)
        self.tied.weight = self.l1.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.relu(self.inp(x))
        h = torch.tanh(self.l2(torch.tanh(self.l1(skip))))
        return self.head(h + skip + torch.tanh(self.tied(h)))


def tangle() -> nn.Sequential:
    """:class:`Tangle` split by torch.export into five blocks (inp, l1, l2, tied, head), as mlp has: a fresh copy
    of one split per process (a trace takes a second; the copy keeps the tied weight shared), the random state
    left as the split left it."""
    model, rng = _split_tangle()
    torch.set_rng_state(rng)
    return copy.deepcopy(model)


@functools.cache
def _split_tangle() -> tuple[nn.Sequential, torch.Tensor]:
    from conveyor.runtime import split_model

    torch.manual_seed(0)
    model = split_model(Tangle(), torch.zeros(2, 8))
    return model, torch.get_rng_state()


MODELS = {
    "mlp": (mlp, {2: [3, 2], 4: [1, 1, 2, 1]}),
    "branchy": (branchy, {2: [2, 2], 4: [1, 1, 1, 1]}),
    "tangle": (tangle, {2: [3, 2], 4: [1, 1, 2, 1]}),
}


def batches(n: int = 3, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 4, (size,), generator=g)) for _ in range(n)]


def factory(batch_size: int) -> tuple[nn.Sequential, torch.Tensor]:
    """A user's model factory as ``conveyor train --model models:factory`` takes it."""
    return nn.Sequential(nn.Linear(3, 3)), torch.zeros(batch_size, 3)


def not_a_model(batch_size: int) -> int:
    """A factory that returns something else."""
    return batch_size


class ResidualMLP(nn.Module):
    """A user's own model for the digits: residual ``forward``s, no ``nn.Sequential`` of blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.hidden = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        for layer in self.hidden:
            h = h + torch.relu(layer(h))
        return self.head(h)


def residual(batch_size: int) -> tuple[nn.Module, torch.Tensor]:
    """``conveyor train --model models:residual``: the user's module as it is."""
    return ResidualMLP(), torch.zeros(batch_size, 64)


def factory_n(n: int) -> tuple[nn.Sequential, torch.Tensor]:
    """A factory whose batch-size parameter has another name."""
    return nn.Sequential(nn.Linear(3, 3)), torch.zeros(n, 3)


def broken(width: int = 3) -> nn.Module:
    """A constructor whose own code fails: its error is its own, not a --model-args one."""
    raise TypeError(f"a bug inside the user's constructor (width {width})")


def small_gpt2() -> nn.Module:
    """transformers' GPT-2 from a small configuration without dropout (so training is deterministic); skips the
    test where transformers is not installed."""
    import pytest

    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (pip install -e '.[models]')"
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=50,
        n_positions=16,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class TokenMixer(nn.Module):
    """Scores for each position from the whole sequence's mean embedding (it sees later tokens), or, ``causal``,
    from the tokens up to it (a running mean); ``outputs`` classes (default the vocabulary)."""

    def __init__(self, vocab: int, causal: bool, outputs: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 8)
        self.head = nn.Linear(8, outputs or vocab)
        self.causal = causal

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.causal:
            h = h.cumsum(1) / torch.arange(1, tokens.shape[1] + 1, device=tokens.device).view(1, -1, 1)
        else:
            h = h.mean(1, keepdim=True).expand_as(h)
        logits: torch.Tensor = self.head(h)
        return logits
