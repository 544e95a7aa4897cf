"""Worker functions for tests/test_sharding.py: importable by the spawned ranks (the tests folder is on sys.path).

Every worker builds the chapter's small ViT from seed 0, so the test process can build the same model and train it
in one process as the reference. Rank r trains on rows ``[r b, (r+1) b)`` of each global batch of ``world * b``.
"""
import copy
import os
import signal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mparlib import sharding
from mparlib.sharded_checkpoint import load_sharded, save_sharded
from mparlib.vit import vit

OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 1e-3}), "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})}


def model(dtype=torch.float32, seed=0):
    """The test model: the smoke ViT with 7x7 patches (16 tokens), about 0.14 M parameters."""
    torch.manual_seed(seed)
    return vit("smoke", patch=7).to(dtype)


def _share(x):
    b = len(x) // dist.get_world_size()
    return x[dist.get_rank() * b:(dist.get_rank() + 1) * b]


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def zero_vs_ddp(batches, optimizer, dtype):
    """Train DDP + ``optimizer`` and ShardedOptimizer(``optimizer``) side by side; both final states and the bytes."""
    cls, options = OPTIMIZERS[optimizer]
    ddp_model = model(dtype)
    zero_model = copy.deepcopy(ddp_model)
    ddp = DDP(ddp_model)
    ddp_opt = cls(ddp.parameters(), **options)
    zero_opt = sharding.ShardedOptimizer(zero_model.parameters(), cls, **options)
    for X, y in batches:
        X, y = _share(X.to(dtype)), _share(y)
        for net, opt in ((ddp, ddp_opt), (zero_model, zero_opt)):
            opt.zero_grad()
            nn.functional.cross_entropy(net(X), y).backward()
            opt.step()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sharding.held_bytes(zero_model, zero_opt))
    return {"ddp": _state(ddp_model), "zero": _state(zero_model), "held": held,
            "shard_size": zero_opt.shard_size, "total": zero_opt.total}


def _fsdp(dtype, seed=0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    net = model(dtype, seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, torch.optim.Adam(net.parameters(), lr=1e-3)


def _full(net, opt):
    """The whole model and optimizer state, gathered on rank 0 (empty dicts elsewhere)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def fsdp_train_and_save(batches, root, dtype):
    """FSDP2 training: the loss of every step (mean over all ranks), the bytes held, then a sharded save."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _fsdp(dtype)
    losses, held = [], None
    for X, y in batches:
        with sharding.CollectiveLog() as log:
            loss = nn.functional.cross_entropy(net(_share(X.to(dtype))), _share(y))
            loss.backward()
        opt.step()
        held = sharding.held_bytes(net, opt)
        opt.zero_grad()
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    model_state, optim_state = get_state_dict(net, opt)
    folder = save_sharded({"model": model_state, "optim": optim_state}, root, step=len(batches))
    full_model, full_optim = _full(net, opt)
    return {"losses": losses, "held": everyone, "collectives": log.summary(), "folder": str(folder),
            "model": full_model, "optim": full_optim}


def fsdp_load(root, dtype):
    """A model from another seed, sharded over this world, loaded from ``root``; its whole state (rank 0)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    net, opt = _fsdp(dtype, seed=1)
    X, y = torch.zeros(2, 1, 28, 28, dtype=dtype), torch.zeros(2, dtype=torch.long)
    nn.functional.cross_entropy(net(X), y).backward()
    opt.step()  # creates the optimizer state that the checkpoint then overwrites
    model_state, optim_state = get_state_dict(net, opt)
    state = {"model": model_state, "optim": optim_state}
    folder = load_sharded(state, root)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_model, full_optim = _full(net, opt)
    return {"folder": str(folder), "model": full_model, "optim": full_optim}


def save_and_get_killed(root, step, victim, dtype):
    """Start a sharded save of a fresh model; rank ``victim`` is killed (SIGKILL) once its own shard is written."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net, opt = _fsdp(dtype, seed=2)
    if dist.get_rank() == victim:
        write_data = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            done = write_data(self, plan, planner)
            done.wait()  # this rank's shard is complete on disk; the index (.metadata) is not written yet
            os.kill(os.getpid(), signal.SIGKILL)

        FileSystemWriter.write_data = write_then_die
    model_state, optim_state = get_state_dict(net, opt)
    save_sharded({"model": model_state, "optim": optim_state}, root, step=step)
    return "the save finished"  # never reached


def zero2_vs_ddp(batches, optimizer, dtype, bucket_bytes, micro=1):
    """DDP + ``optimizer`` beside Zero2Optimizer(``optimizer``), ZeRO-2 in ``micro`` micro-batches per step.

    Returns both final states, and for the last step of ZeRO-2: the parameters whose ``.grad`` survived the
    backward pass, the reduce-scatters done during it, the number of buckets, and the bytes held after the step.
    """
    cls, options = OPTIMIZERS[optimizer]
    ddp_model = model(dtype)
    zero_model = copy.deepcopy(ddp_model)
    ddp = DDP(ddp_model)
    ddp_opt = cls(ddp.parameters(), **options)
    zero_opt = sharding.Zero2Optimizer(zero_model.parameters(), cls, bucket_bytes=bucket_bytes, **options)
    for X, y in batches:
        X, y = _share(X.to(dtype)), _share(y)
        ddp_opt.zero_grad()
        nn.functional.cross_entropy(ddp(X), y).backward()
        ddp_opt.step()
        zero_opt.zero_grad()
        for Xm, ym in zip(X.chunk(micro), y.chunk(micro)):  # equal chunks: the mean of their means is the mean
            (nn.functional.cross_entropy(zero_model(Xm), ym) / micro).backward()
        survived = [n for n, p in zero_model.named_parameters() if p.grad is not None]
        reduced = zero_opt.reduced
        zero_opt.step()
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, sharding.held_bytes(zero_model, zero_opt))
    return {"ddp": _state(ddp_model), "zero": _state(zero_model), "held": held, "survived": survived,
            "reduced": reduced, "buckets": [b.size for b in zero_opt.buckets]}


def _one_block_event(log, i):
    def hook(module, args):
        log.calls.append((f"forward {i}", 0))
    return hook


def fsdp_accumulate_and_hsdp(batches, dtype, micro):
    """On 4 ranks: FSDP2 with gradient accumulation and explicit forward prefetch, then HSDP on a 2 x 2 mesh.

    Returns the final full states (rank 0), the collectives of one step of each, and the order of events
    (all-gathers and block forwards) in the first forward pass with and without explicit prefetch.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    # FSDP2 over all 4 ranks, each global batch in `micro` micro-batches; gradients reduced only on the last one
    net, opt = _fsdp(dtype)
    blocks = list(net.blocks)
    for i, block in enumerate(blocks[:-1]):
        block.set_modules_to_forward_prefetch([blocks[i + 1]])
    out["order_prefetch"] = _forward_order(net, blocks, batches[0], dtype)
    for X, y in batches:
        X, y = _share(X.to(dtype)), _share(y)
        with sharding.CollectiveLog() as log:
            for j, (Xm, ym) in enumerate(zip(X.chunk(micro), y.chunk(micro))):
                net.set_requires_gradient_sync(j == micro - 1)
                (nn.functional.cross_entropy(net(Xm), ym) / micro).backward()
        opt.step()
        opt.zero_grad()
    out["accumulate"], out["accumulate_collectives"] = _full(net, opt)[0], log.summary()
    plain, _ = _fsdp(dtype)
    out["order_plain"] = _forward_order(plain, list(plain.blocks), batches[0], dtype)

    # HSDP: shard within each pair of ranks, replicate across the pairs
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    hsdp = model(dtype)
    for block in hsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(hsdp, mesh=mesh)
    opt = torch.optim.Adam(hsdp.parameters(), lr=1e-3)
    out["placements"] = [str(p) for p in hsdp.blocks[0].attn.q.weight.placements]
    for X, y in batches:
        with sharding.CollectiveLog() as log:
            nn.functional.cross_entropy(hsdp(_share(X.to(dtype))), _share(y)).backward()
        opt.step()
        opt.zero_grad()
    out["hsdp"], out["hsdp_collectives"] = _full(hsdp, opt)[0], log.summary()
    return out


def _forward_order(net, blocks, batch, dtype):
    """The all-gathers and block forwards of one forward pass, in the order they happened."""
    with sharding.CollectiveLog() as log:
        handles = [b.register_forward_pre_hook(_one_block_event(log, i)) for i, b in enumerate(blocks)]
        with torch.no_grad():
            net(_share(batch[0].to(dtype)))
    for h in handles:
        h.remove()
    return [kind for kind, _ in log.calls]
