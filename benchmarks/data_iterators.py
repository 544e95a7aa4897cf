"""Images per second of the two Fashion-MNIST iterators of mparlib.data over one epoch of the training set.

Claim: the device-resident iterator (the whole set as one uint8 tensor on the device, batches gathered and
normalised there) delivers batches much faster than the classic DataLoader over a torchvision-style data set
(one PIL image and one ToTensor per example), so it keeps a training loop from waiting on its input.

Measures only delivering the batches: each batch is touched with a sum (so lazy work cannot be skipped). No model
runs. One untimed warm-up pass over a few batches first; then whole epochs are timed by `mparlib.timing.measure`,
the course's one way to time (CUDA synchronised around each, at least `repeats` epochs); the rate comes from the
median epoch, with the fastest and the slowest epoch beside it. Hardware and software are recorded in the JSON
written to benchmarks/results/data_iterators-<host kind>.json, with `load`: the load average before and after the
run and `busy` (above 0.3 per core).

Run: .venv/bin/python benchmarks/data_iterators.py   (needs the real data set: apt-get install dataset-fashion-mnist)
"""
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

import torch
import torchvision

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import record  # noqa: E402  (benchmarks/record.py: machine, commit, load)
from mparlib import data, sources  # noqa: E402
from mparlib.timing import measure as measure_calls  # noqa: E402

HYPER = {
    "batch_size": 256,             # as in d2l's Fashion-MNIST chapters
    "split": "train",              # 60,000 images, last partial batch kept
    "classic_num_workers": [0, min(4, os.cpu_count() or 1)],  # in-process, and d2l's 4 capped at the CPU count
    "resize": None,                # 28x28 as stored
    "warmup_batches": 5,
    "repeats": 5,                  # epochs timed per iterator, at least; the median is reported
}


def epoch(it, device, seen):
    """One full pass over ``it``, touching every batch; ``seen`` gets the images and the checksum of the pass."""
    total = torch.zeros((), device=device)
    n = 0
    for x, y in it:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total += x.sum() + y.sum()
        n += len(y)
    seen[:] = [n, float(total)]


def measure(name, make, device):
    train, _ = make()
    for i, _batch in enumerate(train):  # warm-up: starts workers, fills caches, initialises CUDA
        if i + 1 >= HYPER["warmup_batches"]:
            break
    seen = []
    t = measure_calls(lambda: epoch(train, device, seen), warmup=0, min_repeats=HYPER["repeats"], min_seconds=0,
                      device=device if device.type == "cuda" else None)
    n, checksum = seen
    return {"iterator": name, "device": str(device), "images": n, "seconds": round(t.median, 4),
            "seconds_min_max": [round(min(t.times), 4), round(max(t.times), 4)], "epochs": len(t.times),
            "images_per_s": round(n / t.median), "batches": len(train), "sum": checksum, "busy": t.busy}


def cpu_model():
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def host_kind():
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return re.sub(r"[^a-z0-9]+", "-", f"{torch.cuda.device_count()}x-{name}".lower()).strip("-")
    return f"cpu-{os.cpu_count()}cores"


def main():
    bs, resize = HYPER["batch_size"], HYPER["resize"]
    start = record.machine()
    sources.read_split(sources.locate(download=False), HYPER["split"])  # read and checked once, outside the clock
    cpu = torch.device("cpu")
    rows = []
    for workers in dict.fromkeys(HYPER["classic_num_workers"]):
        rows.append(measure(f"classic DataLoader, num_workers={workers}", lambda: data.load_fashion_mnist(
            bs, resize=resize, resident=False, num_workers=workers), cpu))
    devices = [cpu] + ([torch.device("cuda:0")] if torch.cuda.is_available() else [])
    for dev in devices:
        if dev.type == "cuda":
            rows.append(measure("classic DataLoader -> cuda:0, pinned", lambda: data.load_fashion_mnist(
                bs, resize=resize, resident=False, device=dev), dev))
        rows.append(measure(f"resident on {dev}", lambda: data.load_fashion_mnist(
            bs, resize=resize, resident=True, device=dev), dev))
    sums = [r["sum"] for r in rows]  # same images and labels in every epoch, up to float summation order
    assert max(sums) - min(sums) <= 1e-5 * max(sums), f"iterators delivered different data: {rows}"
    base = rows[0]["images_per_s"]
    for r in rows:
        r["speedup_vs_first"] = round(r["images_per_s"] / base, 1)

    result = {
        "benchmark": "data_iterators",
        "hyperparameters": HYPER,
        "hardware": {"host_kind": host_kind(), "cpu": cpu_model(),
                     "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                     "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]},
        "software": {"python": platform.python_version(), "torch": torch.__version__,
                     "torchvision": torchvision.__version__, "cuda": torch.version.cuda, "os": platform.platform()},
        "git_commit": record.git_commit(),
        "load": record.load(start),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
    }
    out = Path(__file__).parent / "results" / f"data_iterators-{host_kind()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)

    print(f"Fashion-MNIST {HYPER['split']} epoch, batch {bs}, {host_kind()}, torch {torch.__version__}")
    print(f"{'iterator':<42} {'seconds':>8} {'min-max':>13} {'images/s':>10} {'speed-up':>9}")
    for r in rows:
        low, high = r["seconds_min_max"]
        print(f"{r['iterator']:<42} {r['seconds']:>8.2f} {f'{low:.2f}-{high:.2f}':>13} {r['images_per_s']:>10,} "
              f"{r['speedup_vs_first']:>8.1f}x")
    load = result["load"]
    print(f"load average (1 min) before/after: {load['load_1min_before']:.1f} / {load['load_1min_after']:.1f}, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'not busy'}; written to {out}")


if __name__ == "__main__":
    main()
