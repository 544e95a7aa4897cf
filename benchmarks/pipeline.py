"""The pipeline bubble of torch.distributed.pipelining, measured from per-rank timestamps, against the formula.

Claim under test: with p stages of equal cost and m micro-batches, a GPipe or 1F1B schedule keeps each rank idle
for a fraction (p - 1) / (m + p - 1) of a training step. Goal: on 2 ranks, the measured bubble is within 20% of
the formula (|measured - formula| <= 0.2 x formula) for m >= 4, with both schedules.

Caveat: idle time includes the time messages take, which the formula leaves out, and a machine with fewer free
cores than ranks lets the ranks take turns on the cores (a rank waiting for a core looks busy). The 4-rank rows on
a 2-core machine are therefore recorded but not a test of the formula; the JSON says whether a row had fewer cores
than ranks, and records the load average at the start.

Hardware and software: recorded in the JSON (CPU count, GPUs, torch version, git commit).

Method: `mparlib.schedules.measure_bubble` in p processes (gloo on the CPU unless there is a GPU per rank; one
thread per rank). Every stage is the same stack of `Linear(width, width)` and tanh (`uniform_stage`), so a forward
or backward pass of one micro-batch is the same work on every rank; a micro-batch has `micro_batch_size` rows
whatever m is. Each rank wraps its `PipelineStage` in `StageTimes`, which notes when `forward_one_chunk` and
`backward_one_chunk` start and end (one clock shared by the processes of a machine). For every schedule and m:
`warmup` untimed steps (the first exchanges shapes), then `steps` timed steps between barriers; a step's bubble is
1 - (sum of busy intervals over ranks) / (p x (last end - first start)); the median over the timed steps is
reported beside the formula's value.

Schedules beyond 1F1B (chapter 12): `mparlib.schedules.measure_schedules` runs 1F1B, interleaved 1F1B, ZBV and
DualPipeV on one model of `layers` x (Linear, tanh), cut into p stages (1F1B) or 2p half-size stages (the others,
placed by `stage_indices`), for m in `beyond_micro_batches`. Each row holds the gradient parity with one process
(float64), the median measured bubble and every step's, the formula (`bubble_formula`), the bubble that
`simulate_schedule` gives with the run's own median pass times (computation only, instant messages), the time the
last step spent beyond that replay per pass of a rank (messages and the schedule's own work between passes), the
median and shortest time of each kind of pass (F, B, I, W), and the activations in flight per rank. The per-pass fixed cost is
estimated from the shortest F and B of 1F1B's stages (`layers / p` layers) against interleaved 1F1B's (half as many):
a pass of `k` layers takes `c + k a`, so `c = 2 t(half) - t(full)`.

    python benchmarks/pipeline.py            # the measurement (about two minutes on 2 cores)
    python benchmarks/pipeline.py --quick    # a short check of the script: small stages, two steps
Writes benchmarks/results/pipeline-<host>-<date>.json.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from statistics import mean


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib import schedules  # noqa: E402
from mparlib.devices import num_gpus  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.launch import launch  # noqa: E402
from mparlib.rendezvous import choose_backend  # noqa: E402

HYPER = {
    "nprocs": [2, 4],
    "schedules": ["gpipe", "1f1b"],
    "micro_batches": [1, 2, 4, 8],
    "width": 1024,  # each stage: `layers` x (Linear(width, width), tanh)
    "layers": 8,  # about 20 ms forward, 40 ms backward per micro-batch on one core: messages are small beside it
    "micro_batch_size": 64,  # rows per micro-batch, the same for every m
    "warmup": 1,
    "steps": 5,
    "threads_per_rank": 1,
    "goal": {"nproc": 2, "min_micro_batches": 4, "relative_tolerance": 0.2},
    "beyond": ["1f1b", "interleaved1f1b", "zbv", "dualpipev"],  # measure_schedules (chapter 12)
    "beyond_micro_batches": [4, 8],
    "beyond_width": 512,
    "beyond_layers": 8,  # the whole model: 8 x (Linear, tanh), cut into p or 2p stages
    "beyond_micro_batch_size": 32,
    "beyond_steps": 5,
}
QUICK = {"width": 256, "layers": 2, "micro_batch_size": 16, "steps": 2, "beyond_width": 128, "beyond_steps": 2}


def rows_for(nproc, h):
    result = launch(schedules.measure_bubble, nproc, kwargs=dict(
        schedules=tuple(h["schedules"]), micro_batches=tuple(h["micro_batches"]), width=h["width"], layers=h["layers"],
        micro_batch_size=h["micro_batch_size"], steps=h["steps"], warmup=h["warmup"]),
        threads=h["threads_per_rank"], echo=False, timeout=600)
    rows = []
    for schedule, by_m in result.items():
        for m, r in by_m.items():
            busy = {k: [e - s for notes in r["records"] for kind, _, s, e in notes if kind == k] for k in "FB"}
            rows.append({"nproc": nproc, "schedule": schedule, "micro_batches": m, "measured": r["measured"],
                         "formula": r["formula"], "relative_error": (r["measured"] - r["formula"]) / r["formula"],
                         "steps": r["steps"], "forward_ms": 1e3 * mean(busy["F"]), "backward_ms": 1e3 * mean(busy["B"]),
                         "backend": choose_backend("auto", nproc),
                         "fewer_cores_than_ranks": (os.cpu_count() or 1) < nproc and num_gpus() < nproc})
    return rows


def beyond_rows_for(nproc, h):
    """Rows of the schedules beyond 1F1B on ``nproc`` ranks (measure_schedules)."""
    result = launch(schedules.measure_schedules, nproc, kwargs=dict(
        schedules=tuple(h["beyond"]), micro_batches=tuple(h["beyond_micro_batches"]), width=h["beyond_width"],
        layers=h["beyond_layers"], micro_batch_size=h["beyond_micro_batch_size"], steps=h["beyond_steps"],
        warmup=h["warmup"]), threads=h["threads_per_rank"], echo=False, timeout=600)
    rows = []
    for schedule, by_m in result.items():
        for m, r in by_m.items():
            rows.append({"nproc": nproc, "schedule": schedule, "micro_batches": m, "parity": r["parity"],
                         "measured": r["measured"], "steps": r["steps"], "formula": r["formula"],
                         "simulated_with_measured_passes": r["simulated"], "stage_layers": r["stage_layers"],
                         "gap_per_pass_ms": 1e3 * r["gap_per_pass"],
                         "pass_ms": {k: 1e3 * t for k, t in r["passes"].items()},
                         "fastest_pass_ms": {k: 1e3 * t for k, t in r["fastest"].items()}, "in_flight": r["in_flight"],
                         "saved_bytes_per_stage_micro_batch": r["saved_bytes"],
                         "fewer_cores_than_ranks": (os.cpu_count() or 1) < nproc and num_gpus() < nproc})
    return rows


def fixed_costs(rows):
    """Per nproc and m: the fixed cost of an F and a B pass, from 1F1B's stages against half-size ones.

    The shortest pass of each kind is used: on a shared machine a pass can be slowed (its process loses the core),
    never sped up, so the shortest is closest to its own cost.
    """
    out = []
    for full in (r for r in rows if r["schedule"] == "1f1b"):
        half = [r for r in rows if r["schedule"] == "interleaved1f1b" and r["nproc"] == full["nproc"]
                and r["micro_batches"] == full["micro_batches"]]
        if half:
            out.append({"nproc": full["nproc"], "micro_batches": full["micro_batches"],
                        **{f"{k}_fixed_ms": 2 * half[0]["fastest_pass_ms"][k] - full["fastest_pass_ms"][k]
                           for k in "FB"},
                        **{f"{k}_per_layer_ms": (full["fastest_pass_ms"][k] - half[0]["fastest_pass_ms"][k])
                           / (full["stage_layers"] - half[0]["stage_layers"]) for k in "FB"}})
    return out


def goal_check(rows, goal):
    judged = [r for r in rows if r["nproc"] == goal["nproc"] and r["micro_batches"] >= goal["min_micro_batches"]]
    return {"statement": f"measured bubble within {goal['relative_tolerance']:.0%} of (p-1)/(m+p-1) for m >= "
                         f"{goal['min_micro_batches']} on {goal['nproc']} ranks, both schedules",
            "rows": [{k: r[k] for k in ("schedule", "micro_batches", "measured", "formula", "relative_error")}
                     for r in judged],
            "met": bool(judged) and all(abs(r["relative_error"]) <= goal["relative_tolerance"] for r in judged)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small stages and two timed steps: checks the script only")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}))
    t0 = time.time()
    start = record.machine()
    rows = [row for nproc in h["nprocs"] for row in rows_for(nproc, h)]
    goal = goal_check(rows, h["goal"])
    beyond = [row for nproc in h["nprocs"] for row in beyond_rows_for(nproc, h)]
    result = {
        "benchmark": "pipeline",
        "claim": " ".join(__doc__.split("\n\n")[1].split()),
        "quick": args.quick,
        "hyperparameters": h,
        "rows": rows,
        "goal": goal | ({"note": "a --quick run checks the script; its numbers are not the measurement"}
                        if args.quick else {}),
        "beyond_1f1b": {"rows": beyond, "fixed_cost": fixed_costs(beyond)},
        "hardware": start,
        "load": record.load(start),
        "software": record.software(),
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "pipeline")
    print(f"{'p':>2} {'schedule':<6} {'m':>2} {'measured':>9} {'formula':>8} {'error':>7} {'F ms':>7} {'B ms':>7}")
    for r in rows:
        flag = "  (fewer cores than ranks)" if r["fewer_cores_than_ranks"] else ""
        print(f"{r['nproc']:>2} {r['schedule']:<6} {r['micro_batches']:>2} {r['measured']:>9.3f} {r['formula']:>8.3f} "
              f"{r['relative_error']:>+7.0%} {r['forward_ms']:>7.2f} {r['backward_ms']:>7.2f}{flag}")
    print(f"{'p':>2} {'schedule':<15} {'m':>2} {'parity':>8} {'measured':>9} {'formula':>8} {'simulated':>9} "
          f"{'gap/pass ms':>11} passes (ms)")
    for r in beyond:
        formula = "-" if r["formula"] is None else f"{r['formula']:.3f}"
        passes = " ".join(f"{k}={t:.2f}" for k, t in r["pass_ms"].items())
        print(f"{r['nproc']:>2} {r['schedule']:<15} {r['micro_batches']:>2} {r['parity']:>8.1e} {r['measured']:>9.3f} "
              f"{formula:>8} {r['simulated_with_measured_passes']:>9.3f} {r['gap_per_pass_ms']:>11.2f} {passes}")
    for c in result["beyond_1f1b"]["fixed_cost"]:
        print(f"p={c['nproc']} m={c['micro_batches']}: fixed cost per pass F {c['F_fixed_ms']:.2f} ms, "
              f"B {c['B_fixed_ms']:.2f} ms; per layer F {c['F_per_layer_ms']:.2f} ms, B {c['B_per_layer_ms']:.2f} ms")
    load = result["load"]
    print(f"load average (1 min): {load['load_1min_before']} before, {load['load_1min_after']:.2f} after: "
          f"{'BUSY' if load['busy'] else 'quiet'}")
    print(f"goal ({goal['statement']}): {'met' if goal['met'] else 'NOT met'}"
          + (" [quick run: not a measurement]" if args.quick else ""))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
