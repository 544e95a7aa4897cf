"""Worker functions for tests/test_schedules.py: importable by the spawned ranks (the tests folder is on sys.path)."""
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from mparlib import schedules as pp


def open_links_of_the_v_placement(filtered=True):
    """Every rank: the messages that open the links of ZBV's stages, then the exchange of them (torch 2.11's way).

    Rank 0 returns, per rank, ``{"to_self": messages addressed to the rank itself before filtering, "sent": messages
    exchanged}``; the exchange raises on gloo if a message from a rank to itself is left in (``filtered=False``).
    """
    from torch.distributed.pipelining import PipelineStage

    rank, world = dist.get_rank(), dist.get_world_size()
    cpu = torch.device("cpu")
    stages = [PipelineStage(nn.Linear(4, 4), k, 2 * world, cpu) for k in pp.stage_indices("zbv", rank, world)]
    pp.schedule_class("zbv")(stages, n_microbatches=2 * world, loss_fn=F.mse_loss)  # sets where each stage lives
    every = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops()]
    if filtered:
        stages = [pp.without_self_messages(stage) for stage in stages]
    ops = [op for stage in stages for op in stage._get_init_p2p_neighbors_ops()]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    every_rank = [None] * world
    dist.all_gather_object(every_rank, {"to_self": sum(op.group_peer == rank for op in every), "sent": len(ops)})
    return every_rank
