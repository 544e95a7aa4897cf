"""The planner against 8 processes: the course ViT trained in several layouts, measured beside the prediction.

Claims under test: (1) on every rank of every layout, the collectives of one step are those the planner counts
from the plan the layouts run (mparlib.planner.collectives): the same calls of each kind, the bytes within 1%;
(2) for every layout, the planner's memory per rank (mparlib.planner.memory_per_rank) is within 10% of the largest
peak any rank measured during a step (the median of the runs); (3) the planner orders the layouts by step time as
the measurement does (Spearman rank correlation >= 0.8, on the median step of the runs), when it is fed the inputs
measured in the same runs.

Hardware and software: recorded in the JSON (CPU count, backend, torch version, git commit, the 1-minute load
average before and after, and `busy` when it exceeds 0.3 per core). One machine has no link between nodes: the
planner's two links get the same measured alpha and beta.

Method: `runs` launches (3) of 8 CPU processes (gloo), each with its load average recorded. In each, for each
layout in turn (mparlib.layouts.run_layout), from the seed
of a one-process reference: 3 SGD steps on fixed global batches, whose losses must equal the reference's (checked
here, float32, tolerance 1e-5); then Adam (foreach=False): a warm-up step, two identical steps counted by
mparlib.layouts.StepMemory (every storage live after each operator: parameters, gradients, optimizer state and all
other tensors; the largest rank's peak), one more step inside mparlib.sharding.CollectiveLog (every collective
of every rank), and `timed` steps between barriers (mparlib.timing.measure, the slowest rank's time, median and
quartiles). Then the planner's inputs on the same ranks (mparlib.layouts.measure_inputs):
all-reduces on groups of 2, 4 and 8 neighbours with every group busy at once, fitted to t = alpha + sent_bytes x
beta (sent bytes: the ring's 2(g-1)/g of the message), and the FLOP/s of one rank while all 8 multiply matrices.

    python benchmarks/planner.py            # the measurement (a few minutes on 2 cores)
    python benchmarks/planner.py --quick    # 2 timed steps per layout, one run
Writes benchmarks/results/planner-<host>-<date>.json with rows {"layout", "world_size", "predicted_bytes_per_rank",
"measured_bytes_per_rank" (memory at the peak), "predicted_calls", "measured_calls" (calls per step by collective
kind, first pipeline rank), "predicted_collective_bytes", "measured_collective_bytes" (by kind, the same rank),
"collective_mismatches" (every rank), "predicted_ms", "measured_ms"}, every run's measurements and inputs.
"""
import argparse
import sys
import time
from statistics import median_high
from pathlib import Path

import torch
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib import layouts  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.launch import launch  # noqa: E402

HYPER = {
    "model": {"patch": 7, "dim": 128, "hidden": 512},  # the smoke ViT, 16 tokens (splits over cp), wider
    "global_batch": 32,
    "parity_steps": 3,
    "sgd_lr": 0.05,
    "layouts": [{"dp": 8}, {"dp": 8, "zero": 3}, {"dp": 4, "zero": 3, "tp": 2},
                {"dp": 2, "zero": 3, "tp": 2, "pp": 2, "micro_batches": 2},
                {"dp": 2, "cp": 2, "pp": 2, "micro_batches": 2}],
    "timed": 5,
    "inputs": {"sizes": [2**12, 2**16, 2**20], "groups": [2, 4, 8], "matmul": [512, 128, 512], "repeats": 5},
    "world": 8,
    "memory_goal": 0.10,
    "order_goal": 0.8,
    "bytes_tolerance": 0.01,
    "tolerance": 1e-5,
    "runs": 3,
}
QUICK = {"timed": 2, "runs": 1}


def batches(h, seed=1):
    """The global batches every layout and the reference train on: random images, (B, 1, 28, 28) and (B,)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(h["global_batch"], 1, 28, 28, generator=g), torch.randint(0, 10, (h["global_batch"],),
                                                                                   generator=g))
            for _ in range(h["parity_steps"])]


def reference(h, data):
    """The one-process losses: the same seed, the same batches, SGD on the whole batch."""
    torch.manual_seed(0)
    model = layouts.vit_of(h["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=h["sgd_lr"])
    losses = []
    for x, y in data:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def median_report(reports):
    """One report of the runs' medians: each layout's peak memory and median step, the fits of the run with the
    median all-reduce alpha, and the median FLOP/s."""
    layouts_out = []
    for runs in zip(*(rep["layouts"] for rep in reports)):  # one layout in every run
        step = dict(runs[0]["step"], median=median_high(x["step"]["median"] for x in runs))
        memory = dict(runs[0]["memory"], peak=median_high(x["memory"]["peak"] for x in runs))
        layouts_out.append(dict(runs[0], step=step, memory=memory))
    # the fits of the run whose all-reduce alpha is the median (each kind's alpha with its own beta), and the
    # median FLOP/s of the runs
    alpha = median_high(rep["inputs"]["link"]["alpha"] for rep in reports)
    inputs = next(rep["inputs"] for rep in reports if rep["inputs"]["link"]["alpha"] == alpha)
    inputs = dict(inputs, flops_per_s=median_high(rep["inputs"]["flops_per_s"] for rep in reports))
    return {"layouts": layouts_out, "inputs": inputs}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 timed steps per layout, one run")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}), quick=args.quick)
    t0 = time.time()
    start = record.machine()
    data = batches(h)
    ref = reference(h, data)
    reports, loads = [], []
    for _ in range(h["runs"]):
        before = record.machine()
        reports.append(launch(layouts.layouts_worker, h["world"], args=(h["model"], h["layouts"], data),
                              kwargs={"timed": h["timed"], "inputs": h["inputs"]}, echo=False, timeout=300))
        loads.append(record.load(before))
    for report in reports:
        for r in report["layouts"]:
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref), rtol=h["tolerance"],
                                       atol=h["tolerance"])
    report = median_report(reports)
    compared = layouts.compare(h["model"], report, h["global_batch"], h["memory_goal"], h["order_goal"])
    every_run = list(zip(*(rep["layouts"] for rep in reports)))  # each layout's result in every run
    mismatches = {runs[0]["name"]: [m for run in runs for m in layouts.collective_mismatches(
        h["model"], run, h["global_batch"], h["bytes_tolerance"])] for runs in every_run}
    rows = []
    for r, c, runs in zip(report["layouts"], compared["rows"], every_run):
        predicted = layouts.predicted_collectives(h["model"], r["layout"], h["global_batch"], 0)
        counted = {k: v for k, v in next(x for x in r["collectives"] if x["stage"] == 0).items() if k != "stage"}
        rows.append({"layout": c["layout"], "world_size": h["world"],
                     "predicted_bytes_per_rank": c["predicted_bytes_per_rank"],
                     "measured_bytes_per_rank": c["measured_bytes_per_rank"],
                     "measured_bytes_per_rank_runs": [run["memory"]["peak"] for run in runs],
                     "predicted_calls": {k: v["calls"] for k, v in predicted.items()},
                     "measured_calls": {k: v["calls"] for k, v in counted.items()},
                     "predicted_collective_bytes": {k: v["bytes"] for k, v in predicted.items()},
                     "measured_collective_bytes": {k: v["bytes"] for k, v in counted.items()},
                     "collective_mismatches": mismatches[c["layout"]],
                     "predicted_ms": c["predicted_ms"], "measured_ms": c["measured_ms"],
                     "measured_ms_runs": [run["step"]["median"] * 1e3 for run in runs]})
    goals = dict(compared["goals"])
    goals["collectives"] = {"mismatches": sum(len(m) for m in mismatches.values()), "runs": h["runs"],
                            "met": not any(mismatches.values())}
    result = {
        "benchmark": "planner",
        "claim": " ".join(__doc__.split("\n\n")[1].split()),
        "hyperparameters": h,
        "rows": rows,
        "details": compared["rows"],
        "parity": {"reference": ref, "layouts": {r["name"]: r["losses"] for r in report["layouts"]}},
        "measured": reports,
        "cluster": compared["cluster"],
        "goals": goals,
        "hardware": start | {"backend": "gloo", "processes": h["world"]},
        "load": record.load(start),
        "load_per_run": loads,
        "software": record.software(),
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "planner")
    print(f"{'layout':<22} {'pred MiB':>9} {'meas MiB':>9} {'error':>6} {'pred ms':>8} {'meas ms':>8}  runs (ms)")
    for r, c in zip(rows, compared["rows"]):
        print(f"{r['layout']:<22} {r['predicted_bytes_per_rank'] / 2**20:>9.2f} {r['measured_bytes_per_rank'] / 2**20:>9.2f} "
              f"{c['memory_error']:>+6.0%} {r['predicted_ms']:>8.1f} {r['measured_ms']:>8.1f}  "
              + " ".join(f"{v:.0f}" for v in r["measured_ms_runs"]))
    g = goals
    print(f"collectives: {g['collectives']['mismatches']} mismatches over {h['runs']} runs; memory within "
          f"{h['memory_goal']:.0%}: {'met' if g['memory_within']['met'] else 'NOT met'} (worst |error| "
          f"{g['memory_within']['worst']:.0%}); time order: Spearman {g['time_order']['spearman']:.2f} "
          f"({'met' if g['time_order']['met'] else 'NOT met'})")
    for i, load in enumerate(loads):
        print(f"run {i + 1}: load average (1 min) {load['load_1min_before']} before, {load['load_1min_after']:.2f} "
              f"after, {load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'quiet'}")
    print(f"{result['seconds']} s -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
