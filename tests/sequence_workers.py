"""Worker functions for tests/test_sequence_parallel.py: importable by the spawned ranks.

Every rank builds the same full block from one seed and the same input; rank r gets tokens ``[r T / n, (r+1) T / n)``.
"""
import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from mparlib import sequence_parallel as sp
from mparlib import tensor_parallel as tp
from mparlib.vit import Block


def _setup(seed, dim=16, heads=4, hidden=32, batch=2, tokens=8):
    torch.manual_seed(seed)
    full = Block(dim, heads, hidden).double()
    x = torch.randn(batch, tokens, dim, dtype=torch.float64)
    w = torch.randn(batch, tokens, dim, dtype=torch.float64)
    return full, x, w


def _reference(full, x, w):
    x = x.clone().requires_grad_()
    y = full(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in full.named_parameters()}


def _run_split(part, x, w, sync):
    """Forward and backward of a split block on this rank's tokens; collectives counted in each pass."""
    x_local = sp.shard_sequence(x).clone().requires_grad_()
    with CommDebugMode() as mode:
        y = part(x_local)
        forward = sp.collective_counts(mode)
        (y * sp.shard_sequence(w)).sum().backward()
        total = sp.collective_counts(mode)
    backward = {k: total[k] - forward[k] for k in total}
    synced = sync(part)
    y_full = sp.gather_sequence(y.detach())  # every rank's tokens, side by side (for the comparison)
    gx = sp.gather_sequence(x_local.grad)
    return y_full, gx, {"forward": forward, "backward": backward}, synced


def _diffs(y, gx, grads, ref):
    y_ref, gx_ref, g_ref = ref
    return {"output": (y - y_ref).abs().max().item(), "input grad": (gx - gx_ref).abs().max().item(),
            "names": sorted(grads) == sorted(g_ref),
            "grads": {n: (grads[n] - g_ref[n]).abs().max().item() for n in g_ref}}


def mine(seed=0):
    """The block split with mparlib.sequence_parallel, against the unsplit block."""
    full, x, w = _setup(seed)
    ref = _reference(full, x, w)
    part = sp.split_block(full)
    y, gx, counts, synced = _run_split(part, x, w, sp.sync_replicated_grads)
    out = _diffs(y, gx, tp.gather_full(part, grads=True), ref)
    return out | {"counts": counts, "expected": sp.expected_collectives(part), "synced": synced,
                  "heads": part.attn.heads}


def pytorch(seed=0):
    """The block split with parallelize_module and block_plan(), against the unsplit block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    full, x, w = _setup(seed)
    ref = _reference(full, x, w)
    part = copy.deepcopy(full)
    part.attn.heads //= dist.get_world_size()
    parallelize_module(part, init_device_mesh("cpu", (dist.get_world_size(),)), sp.block_plan())
    y, gx, counts, _ = _run_split(part, x, w, lambda m: None)
    grads = {n: p.grad.full_tensor() for n, p in part.named_parameters()}
    return _diffs(y, gx, grads, ref) | {"counts": counts}


def saved_bytes(seed=0, dim=32, hidden=64, tokens=16, batch=4):
    """Bytes saved for backward on this rank: the unsplit block, tensor parallelism alone, sequence parallelism."""
    full, x, w = _setup(seed, dim=dim, hidden=hidden, tokens=tokens, batch=batch)
    tp_block = copy.deepcopy(full)
    tp_block.attn, tp_block.mlp = tp.split_attention(tp_block.attn), tp.split_mlp(tp_block.mlp)
    out = {}
    for name, block, inp in (("full", full, x), ("tensor", tp_block, x),
                             ("sequence", sp.split_block(full), sp.shard_sequence(x))):
        with sp.SavedBytes(block) as saved:
            block(inp.clone().requires_grad_())
        out[name] = saved.bytes
    return out


def all_checks(seed=0):
    """Both versions and the saved bytes, in one launch; and the errors."""
    errors = {}
    try:
        sp.shard_sequence(torch.zeros(1, 7, 4))
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        errors["uneven"] = (type(e).__name__, str(e))
    return {"mine": mine(seed), "pytorch": pytorch(seed), "saved": saved_bytes(seed), "errors": errors}
