"""Worker functions for the exercise checker's own tests: one right answer, and answers that fail on purpose."""
import torch
import torch.distributed as dist


def reference_sum(x):
    """PyTorch's own all-reduce of ``x * (rank + 1)``."""
    t = x * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def good_sum(x):
    t = x * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return t


def skipping_sum(x):
    t = x * (dist.get_rank() + 1)
    if dist.get_rank() == 0:  # rank 1 never joins: rank 0 waits
        dist.all_reduce(t)
    return t


def both_receive(x):
    t = torch.zeros_like(x)
    dist.recv(t, src=1 - dist.get_rank())  # both ranks receive first: nobody sends
    return t


def failing_on_rank1(x):
    if dist.get_rank() == 1:
        raise IndexError("chunk 2 does not exist")
    return good_sum(x)


def starter(x):
    """The untouched starter."""
    raise NotImplementedError("99.1")


def catches_every_exception(x):
    """An answer that sleeps forever, swallowing the check's alarm and every other exception."""
    import time
    while True:
        try:
            time.sleep(1000)
        except BaseException:  # noqa: BLE001 - the mistake this worker stands for
            pass
