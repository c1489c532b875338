"""Weight transformation: warm-start a child model from a trained parent's weights (ModelKeeper, Net2Net)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from conveyor.errors import InputError

__all__ = ["TransformReport", "identity_init", "transform", "widen_linear_pair"]

_PRODUCERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm)


@dataclass
class TransformReport:
    """What :func:`transform` did.

    Attributes:
        actions: per child module that owns parameters (qualified name), one of ``copied``, ``widened``,
            ``narrowed``, ``sliced``, ``identity`` or ``default``.
        set_elements: parameter elements of the child set from the parent.
        total_elements: parameter elements of the child.
    """

    actions: dict[str, str] = field(default_factory=dict)
    set_elements: int = 0
    total_elements: int = 0

    @property
    def coverage(self) -> float:
        """Fraction of the child's parameter elements set from the parent (0 for a model without any)."""
        return self.set_elements / self.total_elements if self.total_elements else 0.0


# A unit map from a widened or narrowed producer: child unit j is parent unit g[j]; counts[i] = |{j: g[j] = i}|.
_Map = tuple[Tensor, Tensor, str]


def _write(dst: Tensor, src: Tensor) -> int:
    """Copy the overlapping slice ``src[:a, :b, ...]`` into ``dst``; return the elements written."""
    if dst.dim() != src.dim():
        return 0
    index = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape, strict=True))
    dst[index] = src[index].to(dst.dtype)
    return dst[index].numel()


def _unit_map(weight: Tensor, units: int, gen: torch.Generator) -> _Map:
    """The map for a producer with parent ``weight`` (output units first) and ``units`` child units.

    Widening keeps every parent unit and draws the extra ones uniformly: ``g = [0..P-1] + random``.
    Narrowing keeps the ``units`` parent units of largest L2 norm of their incoming weights, in their order.
    """
    parents = weight.shape[0]
    if units >= parents:
        extra = torch.randint(0, parents, (units - parents,), generator=gen)
        g = torch.cat([torch.arange(parents), extra])
        kind = "widened"
    else:
        g = weight.flatten(1).norm(dim=1).topk(units).indices.sort().values
        kind = "narrowed"
    return g, torch.bincount(g, minlength=parents), kind


def _map_inputs(weight: Tensor, unit_map: _Map, block: int) -> Tensor:
    """A consumer's parent ``weight`` with its inputs remapped: ``W2'[:, j] = W2[:, g(j)] / counts[g(j)]``.

    ``block`` input features per unit (1 for Linear->Linear and conv->conv; H*W for conv->Flatten->Linear, where
    unit j's features are ``j*block .. j*block+block-1``).
    """
    g, counts, _ = unit_map
    index = (g[:, None] * block + torch.arange(block)).flatten()
    scale = (1.0 / counts[g].to(weight.dtype)).repeat_interleave(block)
    return weight[:, index] * scale.view(1, -1, *[1] * (weight.dim() - 2))


def widen_linear_pair(
    w1: Tensor, b1: Tensor, w2: Tensor, width: int, *, seed: int = 0
) -> tuple[Tensor, Tensor, Tensor]:
    """Net2WiderNet for ``y = W2 relu(W1 x + b1)``: widen the hidden layer to ``width`` units, same function.

    With ``g = [0..P-1] + (width - P) draws from [0, P)``: ``W1'[j] = W1[g(j)]``, ``b1'[j] = b1[g(j)]``,
    ``W2'[:, j] = W2[:, g(j)] / |{k: g(k) = g(j)}|``.

    Example:
        >>> w1, b1, w2 = torch.randn(3, 2), torch.randn(3), torch.randn(4, 3)
        >>> v1, c1, v2 = widen_linear_pair(w1, b1, w2, 5)
        >>> x = torch.randn(2)
        >>> torch.allclose(w2 @ torch.relu(w1 @ x + b1), v2 @ torch.relu(v1 @ x + c1), atol=1e-6)
        True
    """
    unit_map = _unit_map(w1, width, torch.Generator().manual_seed(seed))
    return w1[unit_map[0]], b1[unit_map[0]], _map_inputs(w2, unit_map, 1)


def _residual(module: nn.Module) -> bool:
    """A residual block shaped like the zoo's ``ResidualBlock`` (conv1, bn1, conv2, bn2 and a skip): told by
    its parts, so this package needs nothing from ``conveyor.job`` (which depends on it)."""
    return all(hasattr(module, a) for a in ("conv1", "bn1", "conv2", "skip")) and isinstance(
        getattr(module, "bn2", None), nn.BatchNorm2d
    )


def _transformer(module: nn.Module) -> bool:
    """A pre-norm transformer block shaped like the zoo's ``TransformerBlock`` (ln1, qkv, proj, an mlp)."""
    return all(hasattr(module, a) for a in ("ln1", "qkv", "proj")) and isinstance(
        getattr(module, "mlp", None), nn.Sequential
    )


def identity_init(module: nn.Module) -> bool:
    """Initialise a new module to (near) the identity where its operator allows; return whether it did.

    A square Linear: ``W = I``, ``b = 0``. A Conv with ``in == out``, one group and odd kernels: Dirac
    (``y = x``), ``b = 0``. A norm layer: weight 1, bias 0 (BatchNorm in eval mode is then ``x / sqrt(1 + eps)``
    on its fresh statistics). A zoo ``ResidualBlock`` with an identity skip: its last BatchNorm's weight and
    bias 0, so it computes ``relu(0 + x) = x`` for ``x >= 0`` (after a ReLU); with a projecting skip (a 1x1
    convolution of stride ``s`` to ``C_out >= C_in`` channels and a BatchNorm) the convolution embeds the input
    channels, ``W[o, i] = 1 if o == i else 0``, so the block computes ``x[:, :, ::s, ::s]`` followed by
    ``C_out - C_in`` zero channels (near the identity: subsampled by the stride; exact in eval mode on fresh
    running statistics, up to ``1 / sqrt(1 + eps)``; in training mode the BatchNorm normalises by the batch's
    statistics). A zoo ``TransformerBlock``: its
    attention projection and last MLP layer 0, so both residual branches add 0. Anything else: unchanged.

    Example:
        >>> layer = nn.Linear(3, 3)
        >>> identity_init(layer), torch.equal(layer(torch.ones(1, 3)), torch.ones(1, 3))
        (True, True)
    """
    with torch.no_grad():
        if isinstance(module, nn.Linear) and module.in_features == module.out_features:
            nn.init.eye_(module.weight)
        elif (
            isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d)
            and module.in_channels == module.out_channels
            and module.groups == 1
            and all(k % 2 == 1 for k in module.kernel_size)
        ):
            nn.init.dirac_(module.weight)
        elif isinstance(module, _NORMS):
            if isinstance(module, nn.LayerNorm) and not module.elementwise_affine:
                return True
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
            return True
        elif _residual(module) and (
            isinstance(module.get_submodule("skip"), nn.Identity) or _embedding_skip(module.get_submodule("skip"))
        ):
            for tensor in module.get_submodule("bn2").parameters():  # weight and bias
                nn.init.zeros_(tensor)
            return True
        elif _transformer(module):
            mlp = module.get_submodule("mlp")
            assert isinstance(mlp, nn.Sequential)
            for layer in (module.get_submodule("proj"), mlp[-1]):
                for tensor in layer.parameters():
                    nn.init.zeros_(tensor)
            return True
        else:
            return False
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor):
            nn.init.zeros_(bias)
        return True


def _embedding_skip(skip: nn.Module) -> bool:
    """Make a projecting skip ``Sequential(Conv 1x1, BatchNorm)`` with ``C_out >= C_in`` embed its input channels
    (``W[o, i] = 1 if o == i``, no bias; the BatchNorm to weight 1, bias 0); False for any other skip."""
    parts = list(skip.children()) if isinstance(skip, nn.Sequential) else []
    conv, norm = parts if len(parts) == 2 else (None, None)
    if not (isinstance(conv, nn.Conv2d) and isinstance(norm, nn.BatchNorm2d)):
        return False
    if conv.kernel_size != (1, 1) or conv.groups != 1 or conv.out_channels < conv.in_channels:
        return False
    nn.init.zeros_(conv.weight)
    conv.weight[: conv.in_channels, :, 0, 0] = torch.eye(conv.in_channels)
    if conv.bias is not None:
        nn.init.zeros_(conv.bias)
    nn.init.ones_(norm.weight)
    nn.init.zeros_(norm.bias)
    return True


def _in_block(name: str, modules: Mapping[str, nn.Module]) -> bool:
    """Whether any ancestor of ``name`` (the root included) is not an ``nn.Sequential``."""
    parts = name.split(".")
    return any(not isinstance(modules[".".join(parts[:i])], nn.Sequential) for i in range(len(parts)))


def _residual_part(name: str, blocks: Mapping[str, object]) -> tuple[str, str] | None:
    """``(block, part)`` when ``name`` is a part of residual block ``block`` (``conv1``, ``skip.0``...)."""
    owner = next((b for b in blocks if name.startswith(b + ".")), None)
    return None if owner is None else (owner, name[len(owner) + 1 :])


def transform(
    parent_state: Mapping[str, Tensor], child: nn.Module, pairs: Sequence[tuple[str, str]], *, seed: int = 0
) -> TransformReport:
    """Set ``child``'s weights (in place) from a trained parent's state dict along the matched ``pairs``.

    The child's parameter-owning modules are visited in registration order, which for an ``nn.Sequential``
    chain is execution order: the "next consumer" of a layer's output is the next Linear/Conv visited, and
    the modules between them are assumed channel-wise (ReLU, dropout, pooling, Flatten in NCHW order, norms).

    Rules, for a paired module (parent weights ``W1, b1``; ``P`` parent units, ``C`` child units):

    - same shapes: copy (exact).
    - widening a Linear/Conv (``C > P``), Net2WiderNet: ``g = [0..P-1] + (C-P)`` uniform draws from
      ``[0, P)``; ``W1'[j] = W1[g(j)]``, ``b1'[j] = b1[g(j)]``. Norm layers on the way map their
      per-channel weight, bias, running mean and variance by ``g`` too. The next consumer gets
      ``W2'[:, j] = W2[:, g(j)] / |{k: g(k) = g(j)}|``, through Flatten per block of ``H*W`` features.
      Exact through ReLU, dropout, pooling and BatchNorm; approximate through LayerNorm (its statistics
      over features change).
    - narrowing (``C < P``): ``g`` = the ``C`` units whose incoming weights have the largest L2 norm, in
      parent order; the same equations (all counts 1); approximate (dropped units' contributions are lost).
    - any other shape mismatch (kernel size, an input dimension not explained by the predecessor's map,
      other module types): copy the overlapping slice ``W[:a, :b, ...]``, the rest keeps its
      initialisation (``sliced``, approximate).
    - through a residual block ``y = relu(bn2(conv2(relu(bn1(conv1 x)))) + skip(x))`` (the zoo's shape), the
      stream's map ``g`` reaches ``conv1``'s inputs and the skip projection's inputs; ``conv1`` draws its own
      map for the inner units; ``conv2``'s outputs take ``g`` itself when the skip is the identity (the sum
      ``y'[j] = y[g(j)]`` stays a replica, exact), else a fresh map ``g'`` that the skip projection's outputs
      share; ``g`` or ``g'`` leaves the block, or no map where a part of the sum was not mapped (unpaired or
      sliced: the chain's next layers are then sliced).
    - inside any other non-``Sequential`` module (a transformer block), maps are not used: shape mismatches
      are sliced (approximate; LayerNorm over the residual stream and heads of a changed size have no exact
      widening here); a map from the chain that reaches such a block is dropped (its inputs are sliced).

    A child module with no parent gets :func:`identity_init` (``identity``; the chain's map passes through
    it), else keeps its default initialisation (``default``). Buffers are mapped like parameters but do not
    count towards coverage.

    Args:
        parent_state: the parent's ``state_dict()``.
        child: the freshly initialised child, modified in place.
        pairs: (parent module name, child module name) of matched modules of the same type.
        seed: seeds the replicated units' draws.

    Returns:
        What was done per child module, and the coverage.

    Raises:
        ValueError: a pair names a module the child does not have.

    Example:
        >>> parent = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> child = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
        >>> report = transform(parent.state_dict(), child, [("0", "0"), ("2", "2")])
        >>> report.actions, report.coverage
        ({'0': 'widened', '2': 'widened'}, 1.0)
        >>> x = torch.randn(5, 4)
        >>> torch.allclose(parent(x), child(x), atol=1e-6)
        True
    """
    to_parent = {c: p for p, c in pairs}
    modules = dict(child.named_modules())
    unknown = sorted(set(to_parent) - set(modules))
    if unknown:
        raise InputError(f"pairs name modules the child does not have: {', '.join(unknown)}")
    walk = _Walk(parent_state, to_parent, modules, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        for name, module in modules.items():
            walk.visit(name, module)
    return walk.report


class _Walk:
    """:func:`transform`'s state as it visits the child's modules in order: the unit map pending for the next
    consumer (``pending``), and per residual block the stream's map into it and its sum's map out of it."""

    def __init__(
        self,
        parent_state: Mapping[str, Tensor],
        to_parent: dict[str, str],
        modules: dict[str, nn.Module],
        gen: torch.Generator,
    ) -> None:
        self.parent_state, self.to_parent, self.modules, self.gen = parent_state, to_parent, modules, gen
        self.report = TransformReport()
        self.identity_blocks = [
            n
            for n, m in modules.items()
            if n not in to_parent
            and (_residual(m) or _transformer(m))
            and not any(c.startswith(n + ".") for c in to_parent)
            and identity_init(m)
        ]
        self.pending: _Map | None = None
        self.entering: dict[str, _Map | None] = {}  # per residual block: the stream's map into it
        self.leaving: dict[str, _Map | None] = {}  # per residual block: the map of its output (its sum)
        self.identity_skips: set[str] = set()
        self.broken: set[str] = set()  # residual blocks whose sum is not a replica under their leaving map
        self.current: str | None = None  # the residual block being visited

    def visit(self, name: str, module: nn.Module) -> None:
        """Set ``module``'s own parameters and buffers, and carry the maps on past it."""
        self._blocks(name, module)
        role = _residual_part(name, self.entering)
        own = dict(module.named_parameters(recurse=False))
        own_buffers = dict(module.named_buffers(recurse=False))
        if not own and not own_buffers:
            return
        self.report.total_elements += sum(p.numel() for p in own.values())
        if inside := next((b for b in self.identity_blocks if name.startswith(b + ".")), None):
            self.report.actions[name] = "identity"  # the block computes its input: the chain's map passes through
            if not isinstance(getattr(self.modules[inside], "skip", nn.Identity()), nn.Identity):
                self.pending = None  # a projecting block adds channels the map does not describe
            return
        block = _in_block(name, self.modules) and role is None
        if block:
            self.pending = None
        elif role is not None and role[1] in ("conv1", "skip", "skip.0"):
            self.pending = self.entering[role[0]]  # these read the block's input
        if name not in self.to_parent:
            self.report.actions[name] = "identity" if identity_init(module) else "default"
            if self.report.actions[name] == "default":
                self.pending = None
            if role is not None and role[1] in ("conv2", "skip", "skip.0"):
                self.broken.add(role[0])  # an output the stream's map does not describe
            return
        prefix = self.to_parent[name] + "."
        keys = [k for k in [*own, *own_buffers] if prefix + k in self.parent_state]
        parent = {k: self.parent_state[prefix + k] for k in keys}
        if isinstance(module, _PRODUCERS) and "weight" in parent:
            action = self._producer(module, parent, role, block)
        elif isinstance(module, _NORMS) and self.pending is not None:
            action = self._norm(module, parent)
        else:
            self.pending, action = None, "copied"
        tensors = {**own, **own_buffers}
        for key, value in parent.items():
            if value.shape != tensors[key].shape and action == "copied":
                action = "sliced"
            written = _write(tensors[key], value)
            if key in own:
                self.report.set_elements += written
        self.report.actions[name] = action if parent else "default"

    def _blocks(self, name: str, module: nn.Module) -> None:
        """Leaving a residual block, the stream takes its sum's map; entering one, it records the stream's map."""
        if self.current is not None and not name.startswith(self.current + "."):
            self.pending = None if self.current in self.broken else self.leaving[self.current]
            self.current = None
        if _residual(module) and name not in self.identity_blocks:
            self.entering[name] = self.pending
            self.leaving[name] = None  # a projecting skip's: conv2 draws it
            if isinstance(module.get_submodule("skip"), nn.Identity):
                self.identity_skips.add(name)
                self.leaving[name] = self.pending
            self.current = name

    def _producer(self, module: nn.Module, parent: dict[str, Tensor], role: tuple[str, str] | None, block: bool) -> str:
        """A Linear or Conv: its inputs mapped by the pending map, its outputs by its own (or the block's);
        ``parent``'s weight and bias replaced by the mapped ones. What was done."""
        w, b, action = parent["weight"], parent.get("bias"), "copied"
        weight = module.get_parameter("weight")
        units_in = weight.shape[1]
        pending = self.pending
        if pending is not None and units_in % len(pending[0]) == 0:
            k = units_in // len(pending[0])
            if w.shape[1] == len(pending[1]) * k:
                w, action = _map_inputs(w, pending, k), pending[2]
        pending = None
        units, (owner, part) = weight.shape[0], role or ("", "")
        if part in ("skip", "skip.0") or (part == "conv2" and owner in self.identity_skips):
            forced = self.leaving[owner]  # the stream's map: the block's sum must stay a replica
            fits = forced is not None and len(forced[0]) == units and len(forced[1]) == w.shape[0]
            pending = forced if fits else None
        elif not block and units != w.shape[0]:
            pending = _unit_map(w, units, self.gen)
        if part == "conv2" and owner not in self.identity_skips:
            self.leaving[owner] = pending  # a projecting skip: its outputs share conv2's fresh map
        if pending is not None:
            w, b, action = w[pending[0]], None if b is None else b[pending[0]], pending[2]
        if w.shape != weight.shape:
            action = "sliced"  # a dimension neither mapped nor equal (or another kernel): overlap only
            if role is not None:
                self.broken.add(owner)
        parent["weight"] = w
        if b is not None:
            parent["bias"] = b
        self.pending = pending
        return action

    def _norm(self, module: nn.Module, parent: dict[str, Tensor]) -> str:
        """A norm after a mapped producer: its per-feature tensors mapped too (or, of another width, the map
        dropped). What was done."""
        assert self.pending is not None
        features = module.normalized_shape[-1] if isinstance(module, nn.LayerNorm) else module.num_features
        if features != len(self.pending[0]):
            self.pending = None
            return "copied"
        for key, value in parent.items():
            if value.dim() >= 1 and value.shape[-1] == len(self.pending[1]):
                parent[key] = value[..., self.pending[0]]
        return self.pending[2]
