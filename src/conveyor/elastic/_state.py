"""The training state as flat tensors: the model's weights, and one owner's shard of the optimizer's state.

The parameters are flattened into one vector of ``P`` elements; a shard ``[a, b)`` of it has its own
optimizer over one flat parameter. For an optimizer whose update is elementwise (SGD with momentum, Adam,
AdamW: every state tensor has the parameter's shape, plus scalars such as Adam's step count) updating the
shards separately is exactly updating the whole model, so where the shards live does not change the
training. A shard's state travels as one tensor, :meth:`ShardOptimizer.message`:
``[weights (b - a), each state vector (b - a), the scalars, the model's float buffers]``.

Example:
    >>> from functools import partial
    >>> model = torch.nn.Linear(3, 2)
    >>> flat = FlatModel(model)
    >>> flat.numel, ShardOptimizer(flat, partial(torch.optim.SGD, lr=0.1, momentum=0.9), (0, 4)).vectors
    (8, 1)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from conveyor.errors import InputError

__all__ = ["FlatModel", "ShardOptimizer", "cut_shard", "full_message_numel", "place_shard", "state_layout"]

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class FlatModel:
    """A model's parameters (one dtype) and float buffers, read and written as flat vectors in host memory.

    The model may sit on a GPU; the vectors are on the CPU whatever its device (elastic training communicates
    over gloo groups in host memory, and an owner's shard steps there): each read is one copy off the device,
    each write one copy onto it.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise InputError(
                f"elastic training needs parameters of one dtype, this model has {sorted(map(str, dtypes))}"
            )
        self.dtype = dtypes.pop()
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.numel = sum(p.numel() for p in self.params)
        self.buffer_numel = sum(b.numel() for b in self.buffers)

    @property
    def device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def weights(self) -> torch.Tensor:
        return parameters_to_vector(self.params).detach().to("cpu", copy=True)

    def grads(self) -> torch.Tensor:
        """The parameters' gradients as one vector (zeros where a parameter has none)."""
        grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.params]
        return torch.cat(grads).cpu()

    def set_weights(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            vector_to_parameters(flat.to(self.device, self.dtype), self.params)

    def buffer_vector(self) -> torch.Tensor:
        if not self.buffers:
            return torch.zeros(0, dtype=self.dtype)
        return torch.cat([b.detach().reshape(-1).to(self.dtype) for b in self.buffers]).to("cpu", copy=True)

    def set_buffers(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            for b, part in zip(self.buffers, flat.split([b.numel() for b in self.buffers]), strict=True):
                b.copy_(part.view_as(b))  # (to the buffer's device)


def state_layout(make_optimizer: OptimizerFactory) -> tuple[list[str], list[str]]:
    """The optimizer's per-element state keys and scalar state keys, found by one step on a probe parameter.

    Raises:
        ValueError: the optimizer keeps state that is neither (its update is not elementwise).

    Example:
        >>> state_layout(lambda p: torch.optim.Adam(p, lr=0.1))
        (['exp_avg', 'exp_avg_sq'], ['step'])
    """
    probe = nn.Parameter(torch.zeros(2))
    optimizer = make_optimizer([probe])
    probe.grad = torch.zeros(2)
    optimizer.step()
    vectors, scalars = [], []
    for key, value in optimizer.state[probe].items():
        if torch.is_tensor(value) and value.shape == probe.shape:
            vectors.append(key)
        elif torch.is_tensor(value) and value.dim() == 0:
            scalars.append(key)
        else:
            raise InputError(
                f"elastic training shards the optimizer's state; {type(optimizer).__name__} keeps {key!r}, which is "
                "neither per element nor a scalar: use an elementwise optimizer (SGD, Adam, AdamW)"
            )
    return sorted(vectors), sorted(scalars)


class ShardOptimizer:
    """The optimizer of the shard ``bounds = (a, b)`` of ``flat``'s parameters, its state made explicit.

    Args:
        flat: the model.
        make_optimizer: builds the optimizer from parameters.
        bounds: the shard, in elements of the flattened parameters.
    """

    def __init__(self, flat: FlatModel, make_optimizer: OptimizerFactory, bounds: tuple[int, int]) -> None:
        self.flat, self.bounds = flat, bounds
        self.keys, self.scalar_keys = state_layout(make_optimizer)
        a, b = bounds
        self.param = nn.Parameter(flat.weights()[a:b].clone())
        self.optimizer = make_optimizer([self.param])
        # An explicit zero state updates exactly as the optimizer's own empty one (SGD's first momentum is the
        # gradient; Adam's moments start at zero and its step at 0), and can be sent and replaced.
        state = self.optimizer.state[self.param]
        for key in self.keys:
            state[key] = torch.zeros_like(self.param)
        for key in self.scalar_keys:
            state[key] = torch.zeros((), dtype=torch.float32)

    @property
    def vectors(self) -> int:
        return len(self.keys)

    @property
    def size(self) -> int:
        return self.bounds[1] - self.bounds[0]

    def message_numel(self) -> int:
        return (1 + self.vectors) * self.size + len(self.scalar_keys) + self.flat.buffer_numel

    def message(self) -> torch.Tensor:
        """This shard's weights, state and scalars, and the model's buffers, as one tensor."""
        state = self.optimizer.state[self.param]
        parts = [self.param.detach(), *(state[k] for k in self.keys)]
        scalars = torch.tensor([float(state[k]) for k in self.scalar_keys], dtype=self.flat.dtype)
        return torch.cat([p.reshape(-1).to(self.flat.dtype) for p in parts] + [scalars, self.flat.buffer_vector()])

    def load(self, message: torch.Tensor) -> None:
        """Take the shard's weights, state and scalars from a :meth:`message` (the buffers are the model's)."""
        n, state = self.size, self.optimizer.state[self.param]
        with torch.no_grad():
            self.param.copy_(message[:n])
            for i, key in enumerate(self.keys, 1):
                state[key].copy_(message[i * n : (i + 1) * n])
            for j, key in enumerate(self.scalar_keys):
                state[key].fill_(float(message[(1 + self.vectors) * n + j]))

    def step(self, grad: torch.Tensor) -> torch.Tensor:
        """Apply the mean gradient of the shard; return the shard's new weights."""
        self.param.grad = grad.to(self.param.dtype).clone()
        self.optimizer.step()
        return self.param.detach()


def full_message_numel(numel: int, vectors: int, scalars: int, buffers: int) -> int:
    """Elements of the whole state: weights and state vectors of every element, the scalars, the buffers."""
    return (1 + vectors) * numel + scalars + buffers


def place_shard(
    full: torch.Tensor,
    message: torch.Tensor,
    *,
    bounds: tuple[int, int],
    numel: int,
    vectors: int,
    buffers: tuple[int, int],
    scalars: int,
) -> None:
    """Copy a shard's :meth:`ShardOptimizer.message` into the whole state ``full`` (laid out as one shard of
    ``[0, numel)``): its weights and state, the ``scalars`` (every shard has the same), and the range
    ``buffers`` of the buffer vector that the shard holds (all of it in data parallelism, where every shard
    has the same; a pipeline stage's own)."""
    a, b = bounds
    n = b - a
    for i in range(1 + vectors):
        full[i * numel + a : i * numel + b] = message[i * n : (i + 1) * n]
    tail, at = full[(1 + vectors) * numel :], message[(1 + vectors) * n :]
    lo, hi = buffers
    tail[:scalars] = at[:scalars]
    tail[scalars + lo : scalars + hi] = at[scalars + lo : scalars + hi]


def cut_shard(full: torch.Tensor, bounds: tuple[int, int], numel: int, vectors: int) -> torch.Tensor:
    """The :meth:`ShardOptimizer.message` of shard ``bounds`` out of the whole state ``full``."""
    a, b = bounds
    rows = [full[i * numel + a : i * numel + b] for i in range(1 + vectors)]
    return torch.cat([*rows, full[(1 + vectors) * numel :]])
