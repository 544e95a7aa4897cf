"""Workers of the layout tests: every layout of a list, built and checked in one launch of the ranks."""
import time

import torch.distributed as dist

from mparlib import layouts


def run_layouts(config, layout_list, batches, timed=2):
    """``layouts.run_layout`` for each layout in turn, on the same ranks; the results in order."""
    out = []
    for layout in layout_list:
        start = time.perf_counter()
        out.append(layouts.run_layout(config, layout, batches, timed=timed))
        dist.barrier()
        out[-1]["wall"] = time.perf_counter() - start
    return out
