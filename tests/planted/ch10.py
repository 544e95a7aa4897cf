"""Planted wrong answers to chapter 10's exercises: each must be rejected with the hint key it names."""
import torch.distributed as dist


def row_parallel_bias_everywhere(x, linear):  # 10.1 -> bias_every_rank
    rank, world = dist.get_rank(), dist.get_world_size()
    step = linear.in_features // world
    part = x[..., rank * step:(rank + 1) * step] @ linear.weight[:, rank * step:(rank + 1) * step].T + linear.bias
    dist.all_reduce(part)
    return part


def row_parallel_partial(x, linear):  # 10.1 -> missing_all_reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    step = linear.in_features // world
    return x[..., rank * step:(rank + 1) * step] @ linear.weight[:, rank * step:(rank + 1) * step].T + linear.bias


def gpipe_order(stage, num_stages, micro_batches):  # 10.2 -> gpipe
    return [("F", i) for i in range(micro_batches)] + [("B", i) for i in range(micro_batches)]


def one_f_one_b_short_warmup(stage, num_stages, micro_batches):  # 10.2 -> warmup_count: p - s - 1 forwards
    warmup = min(micro_batches, num_stages - stage - 1)
    order, forward = [("F", i) for i in range(warmup)], warmup
    for backward in range(micro_batches):
        order.append(("B", backward))
        if forward < micro_batches:
            order.append(("F", forward))
            forward += 1
    return order


def bubble_over_busy(num_stages, micro_batches):  # 10.3 -> over_busy
    return (num_stages - 1) / micro_batches


def bubble_p(num_stages, micro_batches):  # 10.3 -> p_not_p_minus_1
    return num_stages / (micro_batches + num_stages)


PLANTED = [
    ("10.1", "missing_all_reduce", row_parallel_partial),
    ("10.1", "bias_every_rank", row_parallel_bias_everywhere),
    ("10.2", "gpipe", gpipe_order),
    ("10.2", "warmup_count", one_f_one_b_short_warmup),
    ("10.3", "over_busy", bubble_over_busy),
    ("10.3", "p_not_p_minus_1", bubble_p),
]
