"""Training throughput of one process vs DistributedDataParallel, and of DataParallel vs DDP on GPUs.

Claim under test: on a CPU-only machine, 2 gloo processes with one thread each train ResNet-18 (28x28
Fashion-MNIST-sized inputs) at least about as fast as one process using all cores through PyTorch's threads (the
cores are the same; DDP adds a gradient all-reduce per step but runs the Python side in parallel). With GPUs, DDP
with one process per GPU is at least as fast as nn.DataParallel over the same GPUs (PyTorch's documentation
recommends DDP for speed). One process with one thread is measured too, as the baseline for scaling.

Caveat: on a machine shared with other work, more processes get more of the scheduler's time, which favours DDP;
the JSON records the load average before and after (`load`, with `busy` above 0.3 per core) so that such runs can
be recognised.

Hardware and software: recorded in the JSON (CPU count, GPUs, torch version, git commit).

Method: random images and labels of the Fashion-MNIST shape (throughput does not depend on the pixel values),
SGD steps of forward + backward + update, timed by `mparlib.timing.measure` (the course's one way to time, through
`mparlib.throughput`): `warmup` untimed steps, then at least `steps` steps and 50 ms, the clock read after CUDA
synchronisation; DDP ranks meet at a barrier before each step, and a step's time is the slowest rank's. The rate
is computed from the median step; `images_per_s_min_max` comes from the slowest and the fastest step.

    python benchmarks/ddp_throughput.py                 # default settings below
    python benchmarks/ddp_throughput.py --steps 5 --batch 16   # a quick run
Writes benchmarks/results/ddp_throughput-<host>-<date>.json.
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib import throughput  # noqa: E402
from mparlib.devices import num_gpus  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.launch import launch  # noqa: E402

HYPER = {
    "model": "resnet18",
    "global_batch": 32,  # images per optimizer step, split across the processes (CPU); per GPU x GPUs on GPUs
    "gpu_batch_per_device": 256,
    "warmup": 1,
    "steps": 5,  # at least this many timed steps (and 50 ms)
}


def cpu_rows(h):
    cores = os.cpu_count() or 1
    rows = []
    torch.set_num_threads(cores)
    one = throughput.dataparallel(h["model"], batch_size=h["global_batch"], steps=h["steps"], warmup=h["warmup"],
                                  devices=[torch.device("cpu")])
    rows.append({"config": f"1 process, {cores} threads (nn.DataParallel is a pass-through on CPU)", **one})
    if cores > 1:
        torch.set_num_threads(1)
        single = throughput.dataparallel(h["model"], batch_size=h["global_batch"], steps=h["steps"],
                                         warmup=h["warmup"], devices=[torch.device("cpu")])
        rows.append({"config": "1 process, 1 thread", **single})
        torch.set_num_threads(cores)
    for nproc in sorted({2, cores} - {1}):
        if h["global_batch"] % nproc:
            continue
        r = launch(throughput.ddp_worker, nproc, args=(h["model"],),
                   kwargs=dict(per_rank_batch=h["global_batch"] // nproc, steps=h["steps"], warmup=h["warmup"]),
                   backend="gloo", echo=False)
        rows.append({"config": f"DDP, {nproc} gloo processes x {r['threads']} thread(s)", **r})
    return rows


def gpu_rows(h):
    n = num_gpus()
    per = h["gpu_batch_per_device"]
    rows = []
    for k in sorted({1, n}):
        devices = [torch.device("cuda", i) for i in range(k)]
        r = throughput.dataparallel(h["model"], batch_size=per * k, steps=h["steps"], warmup=h["warmup"],
                                    devices=devices)
        rows.append({"config": f"nn.DataParallel over {k} GPU(s)", **r})
        r = launch(throughput.ddp_worker, k, args=(h["model"],),
                   kwargs=dict(per_rank_batch=per, steps=h["steps"], warmup=h["warmup"]), backend="nccl", echo=False)
        rows.append({"config": f"DDP, {k} nccl process(es)", **r})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=HYPER["global_batch"], help="global batch on the CPU")
    ap.add_argument("--steps", type=int, default=HYPER["steps"])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, global_batch=args.batch, steps=args.steps)
    t0, start = time.time(), record.machine()
    rows = cpu_rows(h) if num_gpus() == 0 else gpu_rows(h)
    result = {
        "benchmark": "ddp_throughput",
        "claim": " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
        "hyperparameters": h,
        "rows": rows,
        "hardware": start,
        "software": record.software(),
        "load": record.load(start),
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "ddp_throughput")
    for r in rows:
        low, high = r["images_per_s_min_max"]
        print(f"{r['config']:<60} {r['images_per_s']:8.1f} images/s ({low:.1f}-{high:.1f})")
    load = result["load"]
    print(f"load average (1 min): {load['load_1min_before']} before, {load['load_1min_after']} after, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'not busy'}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
