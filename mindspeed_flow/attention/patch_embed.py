"""Conv -> Matmul for ViT patch embeddings.

A convolution whose stride equals its kernel, without padding, dilation or groups, looks
at disjoint patches: it is one matrix product of the unfolded patches with the kernel
flattened to ``[out_channels, in_channels * prod(kernel)]``.  MindSpeed-MLLM replaced the
Conv3d of Qwen2-VL's ``PatchEmbed`` this way because the convolution was slow on their
hardware; the matmul is also what every accelerator runs fastest.

``PatchEmbedMatmul`` is a drop-in for the convolution (same input and output shapes, same
numbers) and keeps the convolution's parameters as they are: ``weight`` has the conv's
shape ``[E, C, *kernel]`` and is viewed as ``[E, C*prod(kernel)]`` (no copy) in forward.
Its state dict, the optimizer state of its parameters and their sharded (``torch_dist``)
entries are therefore the convolution's, so checkpoints cross ``--flow-conv-matmul`` both
ways with nothing to convert.

``MatmulConv3d`` is the same matmul on a module that stays a ``torch.nn.Conv3d``, for models
whose weight init finds convolutions by type after construction (Hugging Face's
``PreTrainedModel``): their from-scratch init then treats it exactly as upstream's conv.

Earlier versions of mindspeed-flow stored the weight flat, ``[E, C*prod(kernel)]``;
such a state dict still loads (reshaped, with a warning that says how to convert the rest of
the checkpoint).  ``conv_to_matmul_state`` / ``matmul_to_conv_state`` convert saved state
dicts between the two layouts (``mindspeed-flow convert-patch-embed``).
"""

from __future__ import annotations

import logging
import math
from typing import Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ConvNotReplaceable

_CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}

log = logging.getLogger(__name__)


def replaceability_problems(conv: nn.Module) -> list[str]:
    """Why ``conv`` cannot become a matmul; empty when it can."""
    if type(conv) not in _CONVS.values():
        return [f"{type(conv).__name__} is not a torch.nn.Conv1d/Conv2d/Conv3d"]
    problems = []
    if tuple(conv.stride) != tuple(conv.kernel_size):
        problems.append(f"stride {tuple(conv.stride)} differs from kernel_size {tuple(conv.kernel_size)}")
    if isinstance(conv.padding, str) or any(conv.padding):
        problems.append(f"padding {conv.padding!r} is not zero")
    if any(d != 1 for d in conv.dilation):
        problems.append(f"dilation {tuple(conv.dilation)} is not 1")
    if conv.groups != 1:
        problems.append(f"groups={conv.groups} is not 1")
    return problems


def patch_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], in_channels: int,
    kernel_size: tuple[int, ...],
) -> torch.Tensor:
    """A stride == kernel convolution as one matmul: ``patches @ weight.T + bias``.

    ``weight`` is the kernel flattened to ``[E, C*prod(kernel)]`` (a view of the conv-shaped
    parameter).  Same contract as the convolution: ``[B, C, *spatial]`` (or unbatched) in,
    ``[B, E, *spatial // kernel]`` out; trailing pixels that fill no patch are dropped,
    as the convolution drops them."""
    n = len(kernel_size)
    out_channels, features = weight.shape
    unbatched = x.dim() == n + 1
    if unbatched:
        x = x.unsqueeze(0)
    if x.dim() != n + 2 or x.shape[1] != in_channels:
        raise ValueError(
            f"expected [batch, {in_channels}, {n} spatial dims], got {tuple(x.shape)}"
        )
    grid = [s // k for s, k in zip(x.shape[2:], kernel_size)]
    batch = x.shape[0]
    if all(g == 1 for g in grid):
        # One patch per sample (Qwen2-VL feeds patches already unfolded): a plain view.
        patches = x[(..., *(slice(0, k) for k in kernel_size))].reshape(batch, features)
        out = F.linear(patches, weight, bias).view(batch, out_channels, *grid)
    else:
        x = x[(..., *(slice(0, g * k) for g, k in zip(grid, kernel_size)))]
        split = [batch, in_channels]
        for g, k in zip(grid, kernel_size):
            split += [g, k]
        x = x.reshape(split)
        grid_axes = [2 + 2 * i for i in range(n)]
        kernel_axes = [3 + 2 * i for i in range(n)]
        patches = x.permute(0, *grid_axes, 1, *kernel_axes).reshape(batch * math.prod(grid), features)
        out = F.linear(patches, weight, bias).view(batch, *grid, out_channels)
        out = out.permute(0, n + 1, *range(1, n + 1)).contiguous()
    return out.squeeze(0) if unbatched else out


class PatchEmbedMatmul(nn.Module):
    """A stride == kernel convolution computed as ``patches @ weight.view(E, -1).T + bias``.

    Attributes:
        weight: ``[out_channels, in_channels, *kernel_size]``, the convolution's own layout.
        bias: ``[out_channels]`` or None.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: tuple[int, ...],
        bias: bool = True,
        device: Optional[torch.device] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        if len(kernel_size) not in _CONVS:
            raise ValueError(f"kernel_size must have 1 to 3 dimensions, got {kernel_size}")
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = tuple(int(k) for k in kernel_size)
        self.features = in_channels * math.prod(self.kernel_size)
        self.weight = nn.Parameter(torch.empty(self.conv_weight_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_channels, device=device, dtype=dtype)) if bias else None
        self._register_load_state_dict_pre_hook(self._accept_flat_layout)

    @property
    def conv_weight_shape(self) -> tuple[int, ...]:
        """``weight``'s shape: ``(out_channels, in_channels, *kernel_size)``."""
        return (self.out_channels, self.in_channels, *self.kernel_size)

    @property
    def flat_weight_shape(self) -> tuple[int, int]:
        """The matmul's view of ``weight`` (and the stored layout before this version)."""
        return (self.out_channels, self.features)

    def matmul_weight(self) -> torch.Tensor:
        """``weight`` as ``[E, C*prod(kernel)]``: a view, so gradients reach ``weight``."""
        return self.weight.reshape(self.flat_weight_shape)

    @classmethod
    def from_conv(cls, conv: nn.Module) -> "PatchEmbedMatmul":
        """The equivalent module, sharing no storage with ``conv``; refuses what it cannot replace."""
        problems = replaceability_problems(conv)
        if problems:
            raise ConvNotReplaceable(
                f"cannot replace {conv!r} by a matmul: " + "; ".join(problems)
            )
        module = cls(
            conv.in_channels, conv.out_channels, tuple(conv.kernel_size), bias=conv.bias is not None,
            device=conv.weight.device, dtype=conv.weight.dtype,
        )
        with torch.no_grad():
            module.weight.copy_(conv.weight)
            if conv.bias is not None:
                module.bias.copy_(conv.bias)
        for ours, theirs in ((module.weight, conv.weight), (module.bias, conv.bias)):
            if theirs is not None:
                ours.requires_grad_(theirs.requires_grad)
                # attributes a framework set on the conv's parameters (Megatron's
                # tensor-parallel markers, ...) stay with the parameter
                for name, value in vars(theirs).items():
                    setattr(ours, name, value)
        module.train(conv.training)
        return module

    def to_conv(self) -> nn.Module:
        """The equivalent upstream convolution (for export or comparison)."""
        conv = _CONVS[len(self.kernel_size)](
            self.in_channels, self.out_channels, self.kernel_size, stride=self.kernel_size,
            bias=self.bias is not None, device=self.weight.device, dtype=self.weight.dtype,
        )
        with torch.no_grad():
            conv.weight.copy_(self.weight)
            if self.bias is not None:
                conv.bias.copy_(self.bias)
        return conv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Same contract as the convolution: see :func:`patch_matmul`."""
        return patch_matmul(x, self.matmul_weight(), self.bias, self.in_channels, self.kernel_size)

    def _accept_flat_layout(self, state_dict, prefix, *args) -> None:
        """Let a state dict saved by an earlier mindspeed-flow (weight ``[E, C*prod(k)]``) load.

        Only the model's entry can be fixed here; the optimizer's entries of that weight are
        loaded by Megatron later, without a hook, so the warning says how to convert them."""
        key = prefix + "weight"
        weight = state_dict.get(key)
        if weight is None or tuple(weight.shape) != self.flat_weight_shape:
            return
        state_dict[key] = weight.reshape(self.conv_weight_shape)
        log.warning(
            "mindspeed-flow: %s %s is the flattened patch-embedding layout that earlier versions "
            "of mindspeed-flow saved with --flow-conv-matmul; loaded as the convolution's %s, the "
            "layout upstream and this version save. Optimizer state saved beside it (--ckpt-format torch "
            "without --use-distributed-optimizer) still has the old shape and fails to load: "
            "convert the checkpoint file once with `mindspeed-flow convert-patch-embed IN OUT "
            "--to conv --in-and-kernel %s --trust-checkpoint` (model and optimizer state), or "
            "resume with --no-load-optim", key, list(weight.shape), list(self.conv_weight_shape),
            ",".join(str(d) for d in self.conv_weight_shape[1:]))

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
                f"bias={self.bias is not None}")


class MatmulConv3d(nn.Conv3d):
    """A ``torch.nn.Conv3d`` (stride == kernel) whose forward is :func:`patch_matmul`.

    For models that find their convolutions by type after construction: Hugging Face's
    ``PreTrainedModel._init_weights`` (``post_init``, and MindSpeed-MM's ``init_weights`` after
    meta-device FSDP2 sharding) initialises ``isinstance(module, nn.Conv3d)`` with
    ``normal_(0, initializer_range)``.  A :class:`PatchEmbedMatmul` is skipped there: its weight
    keeps the conv's default init (or, after ``to_empty``, uninitialised memory) and every
    module initialised after it draws other random numbers.  This class stays a Conv3d, so such
    an init treats it, and draws from the RNG, exactly as it treats upstream's conv.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patch_matmul(x, self.weight.reshape(self.out_channels, -1), self.bias, self.in_channels,
                            tuple(self.kernel_size))

    @classmethod
    def adopt(cls, conv: nn.Module) -> "MatmulConv3d":
        """``conv`` itself, now of this class (as ``torch.nn.utils.parametrize`` re-classes a module).

        Nothing is built or copied: the parameters, their attributes, hooks and flags stay, and no
        random number is drawn (building a new Conv3d would draw its default init and shift every
        later init of a seeded model).  Refuses what cannot become a matmul."""
        problems = (replaceability_problems(conv) if type(conv) is nn.Conv3d
                    else [f"{type(conv).__name__} is not a torch.nn.Conv3d"])
        if problems:
            raise ConvNotReplaceable(f"cannot give {conv!r} a matmul forward: " + "; ".join(problems))
        conv.__class__ = cls
        return conv


def conv_to_matmul_state(state: Mapping[str, torch.Tensor], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """A copy of ``state`` whose conv weights at ``keys`` are flattened to ``[E, C*prod(k)]``."""
    out = dict(state)
    for key in keys:
        weight = _weight(state, key)
        if weight.dim() < 3:
            raise ValueError(f"{key}: shape {tuple(weight.shape)} is not a conv weight (already matmul layout?)")
        out[key] = weight.reshape(weight.shape[0], -1).clone()
    return out


def matmul_to_conv_state(
    state: Mapping[str, torch.Tensor], keys: Iterable[str], in_and_kernel: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """A copy of ``state`` whose matmul weights at ``keys`` get the conv shape ``[E, C, *kernel]``.

    ``in_and_kernel`` is ``(C, *kernel)``, e.g. ``(3, 2, 14, 14)`` for Qwen2-VL: the flat
    weight alone does not say how its columns split.
    """
    out = dict(state)
    for key in keys:
        weight = _weight(state, key)
        if weight.dim() != 2:
            raise ValueError(f"{key}: shape {tuple(weight.shape)} is not a matmul weight (already conv layout?)")
        if weight.shape[1] != math.prod(in_and_kernel):
            raise ValueError(
                f"{key}: {weight.shape[1]} columns cannot split into in_channels x kernel {tuple(in_and_kernel)}"
            )
        out[key] = weight.reshape(weight.shape[0], *in_and_kernel).clone()
    return out


def _weight(state: Mapping[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in state:
        raise KeyError(f"{key} is not in the state dict")
    return state[key]


def replace_conv(parent: nn.Module, attribute: str) -> PatchEmbedMatmul:
    """Swap ``parent.<attribute>`` (a patch-embedding conv) for its matmul equivalent."""
    replacement = PatchEmbedMatmul.from_conv(getattr(parent, attribute))
    setattr(parent, attribute, replacement)
    return replacement


def matmul_forward_for_conv(parent: nn.Module, attribute: str) -> MatmulConv3d:
    """Give ``parent.<attribute>`` (a patch-embedding Conv3d) the matmul forward, keeping its type."""
    return MatmulConv3d.adopt(getattr(parent, attribute))
