"""Instructor solutions of chapter 12's exercises."""


def interleaved_bubble(num_stages, micro_batches, stages_per_rank):
    """12.1: the idle share of interleaved 1F1B: fill and drain through p - 1 stages v times smaller."""
    idle = (num_stages - 1) / stages_per_rank
    return idle / (idle + micro_batches)


def state_bytes_per_rank(n_params, dp, tp, pp, stage):
    """12.2: fp32 parameters, gradients and Adam state of a rank's part of the model, ZeRO ``stage`` over dp."""
    k = n_params / (tp * pp)
    params = 4 * k / (dp if stage >= 3 else 1)
    grads = 4 * k / (dp if stage >= 2 else 1)
    adam = 8 * k / (dp if stage >= 1 else 1)
    return params + grads + adam


def in_flight(schedule, stage, num_stages, micro_batches):
    """12.3: the most micro-batches a stage holds between forward and backward: all of them in GPipe."""
    if schedule == "gpipe":
        return micro_batches
    return min(micro_batches, num_stages - stage)


SOLUTIONS = {"12.1": interleaved_bubble, "12.2": state_bytes_per_rank, "12.3": in_flight}
