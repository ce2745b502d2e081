"""``average_coalesced`` (what ``DecoupledLayout.average_grads`` runs) on two gloo ranks:
one flat all-reduce per gradient dtype, each gradient the peers' mean in its own dtype,
frozen and gradient-less parameters left alone, and a parameter with a gradient on only
one peer refused on both, naming it, before any gradient changes."""

from __future__ import annotations

import torch
from torch import nn

from megatron_cpu_harness import launch


def _module() -> nn.Module:
    module = nn.Module()
    module.w32 = nn.Parameter(torch.zeros(2, 3))
    module.b32 = nn.Parameter(torch.zeros(3))
    module.w64 = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    module.wbf16 = nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    module.unused = nn.Parameter(torch.zeros(5))
    module.frozen = nn.Parameter(torch.zeros(2), requires_grad=False)
    return module


def _grads(module: nn.Module, rank: int) -> None:
    """Rank ``r``'s gradients: ``(r + 1)`` times small integers (exact in bfloat16 too)."""
    for i, name in enumerate(("w32", "b32", "w64", "wbf16")):
        param = getattr(module, name)
        param.grad = (torch.arange(param.numel()).reshape(param.shape) + i).to(param.dtype) * (rank + 1)
    module.frozen.grad = torch.full((2,), 7.0)  # not trainable: never reduced


def _worker(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from mindspeed_flow.decoupled import average_coalesced

    calls = []
    all_reduce = dist.all_reduce
    dist.all_reduce = lambda tensor, **kw: calls.append((tensor.dtype, tensor.numel())) or all_reduce(tensor, **kw)
    try:
        module = _module()
        _grads(module, rank)
        average_coalesced(module.named_parameters(), None, count=world_size)
        averaged = {n: (None if p.grad is None else p.grad.clone()) for n, p in module.named_parameters()}
        reduces = list(calls)

        _grads(module, rank)
        if rank == 0:
            module.unused.grad = torch.ones(5)
        try:
            average_coalesced(module.named_parameters(), None, count=world_size)
            error = None
        except ValueError as exc:
            error = str(exc)
        untouched = module.w32.grad.clone()
        return {"averaged": averaged, "reduces": reduces, "error": error, "untouched": untouched}
    finally:
        dist.all_reduce = all_reduce


def test_average_coalesced_reduces_once_per_dtype_and_refuses_mixed_grads():
    ranks = launch(_worker, 2, timeout_s=120)
    reference = _module()
    _grads(reference, 0)
    for rank, out in enumerate(ranks):
        # 1 (rank 0) and 2 (rank 1) times the integers: the mean is 1.5 times them
        for name in ("w32", "b32", "w64", "wbf16"):
            want = getattr(reference, name).grad * 1.5
            got = out["averaged"][name]
            assert got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"rank {rank} {name}")
        assert out["averaged"]["unused"] is None
        torch.testing.assert_close(out["averaged"]["frozen"], torch.full((2,), 7.0))
        # float32: w32, b32, unused (as zeros) + 2 flags each; float64 and bfloat16: one param each
        assert sorted(out["reduces"], key=str) == sorted(
            [(torch.float32, 6 + 3 + 5 + 6), (torch.float64, 4 + 2), (torch.bfloat16, 4 + 2)], key=str)
        assert out["error"] is not None and "['unused']" in out["error"] and "some ranks" in out["error"], out
        torch.testing.assert_close(out["untouched"], reference.w32.grad * (rank + 1), rtol=0, atol=0)
