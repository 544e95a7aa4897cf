"""What mparlib.parallel.data_parallel costs on k simulated CPU devices, compared with calling the model directly.

Claim (issue "mparlib.parallel"): for the course's ResNet-18 at batch 256, data_parallel over 2 simulated devices
(["cpu", "cpu"]) costs less than 10% more time per training step than the direct call, because each chunk is still
compute-bound; for a small MLP the fixed costs (copying the weights, one thread per replica, gathering) show.

Measures one training step, forward + backward (cross-entropy on random labels), with the model in train mode and
gradients set to None before each step (untimed). The steps are timed by `mparlib.timing.measure_each`, the course's
one way to time: warm-up steps, then direct and data_parallel steps in turn, round by round, so that load from other
processes on a shared machine hits both alike, at least `repeats` rounds and 50 ms in all. Reported: the
median step time, the quartiles, the ratio data_parallel / direct, and also the fastest step of each (the least
disturbed one when other jobs share the cores); `load` holds the load average before and after the run and `busy`
(above 0.3 per core).
No CUDA here: simulated devices share the same CPU cores, so this measures overhead, not a speed-up.
Hardware, software, machine load and the git commit are written to benchmarks/results/parallel_overhead-cpu.json.

Run: .venv/bin/python benchmarks/parallel_overhead.py [--only mlp|resnet18]
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from mparlib.parallel import data_parallel  # noqa: E402
from mparlib.timing import measure_each  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)

HYPER = {
    # torch_threads: None keeps PyTorch's default (one intra-op thread per core); 1 shows the cost without the
    # oversubscription of k replica threads each starting a team of intra-op threads on the same cores.
    "mlp": {"layers": [784, 256, 256, 10], "batch": 256, "ks": [1, 2, 4], "warmup": 3, "repeats": 50,
            "torch_threads": [None, 1]},
    # d2l's ResNet-18 for Fashion-MNIST: 1x28x28 images, 10 classes. One step takes seconds on a few CPU cores,
    # so only the course's minimum of 5 repetitions is measured.
    "resnet18": {"image": [1, 28, 28], "classes": 10, "batch": 256, "ks": [2], "warmup": 1, "repeats": 5},
    "seed": 0,
}


def mlp():
    sizes = HYPER["mlp"]["layers"]
    layers = [nn.Flatten()]
    for a, b in zip(sizes[:-1], sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def resnet18():
    from mparlib.models import resnet18 as build

    return build(HYPER["resnet18"]["classes"]), "mparlib.models.resnet18"


def step(net, x, y, devices):
    """One forward + backward, as a function of no arguments; ``devices=None`` is the direct call."""
    def run():
        out = net(x) if devices is None else data_parallel(net, x, devices)
        F.cross_entropy(out, y).backward()
    return run


def compare(net, x, y, k, warmup, repeats):
    """Direct and data_parallel steps timed in turn; medians, quartiles and their ratio."""
    t = measure_each({"direct": step(net, x, y, None), "data_parallel": step(net, x, y, ["cpu"] * k)},
                     warmup=warmup, min_repeats=repeats, before=lambda: net.zero_grad(set_to_none=True))
    d, p = t["direct"], t["data_parallel"]
    return {"k": k, "direct_s": [round(v, 5) for v in d.times], "data_parallel_s": [round(v, 5) for v in p.times],
            "direct_median_s": round(d.median, 5), "data_parallel_median_s": round(p.median, 5),
            "direct_q1_q3_s": [round(v, 5) for v in d.quartiles],
            "data_parallel_q1_q3_s": [round(v, 5) for v in p.quartiles],
            "ratio": round(p.median / d.median, 3), "overhead_pct": round(100 * (p.median / d.median - 1), 1),
            # On a machine shared with other jobs the fastest step is the least disturbed one.
            "direct_min_s": round(min(d.times), 5), "data_parallel_min_s": round(min(p.times), 5),
            "ratio_of_min": round(min(p.times) / min(d.times), 3), "busy": d.busy}


def git_state():
    def git(*args):
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        except OSError:
            return ""
    mine = ["mparlib/parallel.py", "benchmarks/parallel_overhead.py"]
    return {"commit": git("rev-parse", "HEAD") or None,
            "uncommitted_changes_to_measured_files": bool(git("status", "--porcelain", "--", *mine))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["mlp", "resnet18"], help="measure one model only")
    args = parser.parse_args()
    torch.manual_seed(HYPER["seed"])
    start = record.machine()
    rows = []

    default_threads = torch.get_num_threads()
    if args.only in (None, "mlp"):
        h = HYPER["mlp"]
        net = mlp().train()
        x, y = torch.randn(h["batch"], h["layers"][0]), torch.randint(0, h["layers"][-1], (h["batch"],))
        for threads in h["torch_threads"]:
            torch.set_num_threads(threads or default_threads)
            for k in h["ks"]:
                rows.append({"model": "MLP " + "-".join(map(str, h["layers"])), "batch": h["batch"],
                             "torch_threads": torch.get_num_threads(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                             **compare(net, x, y, k, h["warmup"], h["repeats"])})
                print(rows[-1]["model"], f"threads={threads or default_threads} k={k}: ratio {rows[-1]['ratio']}",
                      flush=True)
        torch.set_num_threads(default_threads)

    if args.only in (None, "resnet18"):
        h = HYPER["resnet18"]
        net, source = resnet18()
        net.train()
        x, y = torch.randn(h["batch"], *h["image"]), torch.randint(0, h["classes"], (h["batch"],))
        for k in h["ks"]:
            rows.append({"model": f"ResNet-18 ({source})", "batch": h["batch"], "torch_threads": default_threads,
                         "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                         **compare(net, x, y, k, h["warmup"], h["repeats"])})
            print(rows[-1]["model"], f"k={k}: ratio {rows[-1]['ratio']}", flush=True)

    result = {
        "benchmark": "parallel_overhead",
        "claim": "data_parallel on 2 simulated CPU devices costs < 10% over the direct call for ResNet-18 at batch 256",
        "hyperparameters": HYPER,
        "hardware": {"cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                     "torch_threads": torch.get_num_threads(),
                     "gpus": []},
        "load": record.load(start),
        "software": {"python": platform.python_version(), "torch": torch.__version__, "os": platform.platform()},
        "git": git_state(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "results": rows,
    }
    out = ROOT / "benchmarks" / "results" / "parallel_overhead-cpu.json"
    if args.only and out.exists():  # keep the other model's rows from the previous run (each row has its time)
        earlier = json.loads(out.read_text())
        kept = [r for r in earlier["results"] if not r["model"].lower().startswith(
            "mlp" if args.only == "mlp" else "resnet")]
        for r in kept:
            r.setdefault("time", earlier["time"])
            r.setdefault("torch_threads", earlier["hardware"]["torch_threads"])
            r.setdefault("load", earlier.get("load"))  # the run it came from (absent in runs before `load` existed)
        rows = [r for r in rows if r["model"].lower().startswith("mlp")] + kept + \
            [r for r in rows if not r["model"].lower().startswith("mlp")]
        result["results"] = rows
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out)

    print(f"\nOne training step (forward + backward), median; {os.cpu_count()} CPU cores, "
          f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"{'model':<38} {'threads':>7} {'k':>2} {'direct s':>9} {'data_parallel s':>16} {'ratio':>6} "
          f"{'ratio of fastest':>17}")
    for r in rows:
        print(f"{r['model']:<38} {r.get('torch_threads', '-'):>7} {r['k']:>2} {r['direct_median_s']:>9.4f} "
              f"{r['data_parallel_median_s']:>16.4f} {r['ratio']:>6.2f} {r['ratio_of_min']:>17.2f}")
    load = result["load"]
    print(f"load average (1 min) before/after: {load['load_1min_before']:.1f} / {load['load_1min_after']:.1f}, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'not busy'}; written to {out}")


if __name__ == "__main__":
    main()
