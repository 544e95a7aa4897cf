"""Memory per rank of FSDP2 on 1, 2 and 4 processes, the time of its training steps, and the peak memory per rank
of DDP, ZeRO-1, ZeRO-2 and FSDP2.

Claim under test: with `fully_shard` on every transformer block and at the root, the parameters, gradients and
Adam state that each rank holds add up to at most 1.15 x (the one-process total) / N for N = 2 and 4 (chapter 9's
goal; the excess is FSDP2's padding of each parameter's first dimension to a multiple of N). Step times are
recorded beside the memory: sharding trades memory for communication, and on CPU processes with gloo the
all-gathers and reduce-scatters of every block are not free. Second claim: the peak of the training state
(parameters, gradients, optimizer state) that a rank holds at any moment of a step orders
FSDP2 < ZeRO-2 < ZeRO-1 < DDP for N = 2 and 4, and ZeRO-2's peak gradient bytes per rank are at most 1/N of the full
gradients plus one bucket plus the one parameter gradient autograd has just produced (the issue's goal).

Hardware and software: recorded in the JSON (CPU count, GPUs, torch version, commit, and `load`: the 1-minute load
average before and after the run, per core, and `busy` when it exceeds 0.3 per core).

Method: the chapter's ViT (`mparlib.vit`, size "small": 3.2 M parameters), Adam, each rank a random batch of
`batch_per_rank` Fashion-MNIST-shaped images (memory and time do not depend on the pixels). The worker is
`mparlib.sharding.fsdp_memory_worker`: bytes are counted from each rank's tensors (`sharding.held_bytes`: a
DTensor's local shard, every storage once, padding included) right after the last optimizer step, while
parameters, gradients and optimizer state all exist; the largest rank's count is reported for each part, and
every rank's in `per_rank`. On GPUs `torch.cuda.max_memory_allocated` is recorded per rank too. The peaks
(`peak_bytes_per_rank`, largest rank, per method) come from `mparlib.sharding.peak_memory_worker`: one warm-up step,
then one step inside `sharding.PeakMemory`, which counts the training state after every operator the step runs
(forward, backward, collectives, optimizer) and keeps the largest total; `peak_all_bytes_per_rank` adds every other
tensor alive at that moment (activations, temporaries, communication buffers). The counts are deterministic, so one
measured step per method is enough; they do not depend on the load of the machine. The step times come after the
memory is counted (`steps` untimed training steps, which are also the warm-up), by `mparlib.timing.measure`, the
course's one way to time: at least 5 steps and 50 ms, each after a barrier and until CUDA has finished, the slowest
rank's time; `step_s` holds their median, spread and every time. CPU ranks share the cores (the launcher's default:
cores // N threads each, recorded as `threads_per_rank`); on a machine busy with other work, several threads per
rank can wait on each other badly, so trust times only from a run whose `load.busy` is false.
All world sizes use the same backend: nccl when there is a GPU for each process of the largest world, else gloo.

    python benchmarks/sharding.py            # vit("small") on 1, 2 and 4 processes
    python benchmarks/sharding.py --quick    # vit("smoke"), smaller batches: a short check that it all runs
Writes benchmarks/results/sharding-<host>-<date>.json (sharding-quick-... with --quick).
"""
import argparse
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib.devices import num_gpus  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.launch import launch  # noqa: E402
from mparlib.sharding import PEAK_METHODS, fsdp_memory_worker, peak_memory_worker  # noqa: E402

HYPER = {
    "model": "small",  # mparlib.vit size
    "batch_per_rank": 8,
    "steps": 1,  # untimed training steps before the bytes are counted; the timed steps follow
    "lr": 1e-3,
    "worlds": [1, 2, 4],
    "goal_ratio": 1.15,  # params + grads + optimizer per rank <= goal_ratio x one-process total / N
    "bucket_bytes": 2**20,  # ZeRO-2's gradient buckets
}
QUICK = {"model": "smoke", "batch_per_rank": 4, "steps": 1}


def measure(h, backend):
    rows = []
    for n in h["worlds"]:
        r = launch(fsdp_memory_worker, n, kwargs=dict(size=h["model"], batch=h["batch_per_rank"], steps=h["steps"],
                                                      lr=h["lr"]),
                   backend=backend, echo=False, timeout=600)
        peaks = launch(peak_memory_worker, n, kwargs=dict(size=h["model"], batch=h["batch_per_rank"], lr=h["lr"],
                                                          bucket_bytes=h["bucket_bytes"]),
                       backend=backend, echo=False, timeout=600)["methods"]
        total = sum(r["bytes_per_rank"].values())
        rows.append({"world_size": n, "device": r["device"], "threads_per_rank": r["threads"],
                     "bytes_per_rank": r["bytes_per_rank"],
                     "total_per_rank": total, "per_rank": r["per_rank"], "step_s": r["step_s"],
                     "median_step_s": r["step_s"]["median"],
                     "collectives_per_step": r["collectives_per_step"],
                     "peak_bytes_per_rank": {m: peaks[m]["peak_bytes_per_rank"] for m in PEAK_METHODS},
                     "peak_all_bytes_per_rank": {m: peaks[m]["peak_all_bytes_per_rank"] for m in PEAK_METHODS},
                     "peak_parts_per_rank": {m: [x["parts"] for x in peaks[m]["per_rank"]] for m in PEAK_METHODS}})
    return rows


def peak_goals(rows, h, full_grads, largest_param):
    out = []
    for r in rows:
        if r["world_size"] in (2, 4):
            p = r["peak_bytes_per_rank"]
            out.append({"goal": "peak per rank: FSDP2 < ZeRO-2 < ZeRO-1 < DDP", "world_size": r["world_size"],
                        "value": [p[m] for m in ("FSDP2", "ZeRO-2", "ZeRO-1", "DDP")],
                        "met": p["FSDP2"] < p["ZeRO-2"] < p["ZeRO-1"] < p["DDP"]})
            grads = max(x["grads"] for x in r["peak_parts_per_rank"]["ZeRO-2"])
            limit = full_grads / r["world_size"] + max(h["bucket_bytes"], largest_param) + largest_param
            out.append({"goal": "ZeRO-2 peak gradient bytes <= full / N + one bucket + one parameter's gradient",
                        "world_size": r["world_size"], "value": grads, "limit": round(limit),
                        "ratio_to_full_over_n": round(grads / (full_grads / r["world_size"]), 4),
                        "met": grads <= limit})
    return out


def goals(rows, ratio):
    single = next(r["total_per_rank"] for r in rows if r["world_size"] == 1)
    out = []
    for r in rows:
        if r["world_size"] in (2, 4):
            limit = ratio * single / r["world_size"]
            out.append({"goal": f"params + grads + optimizer per rank <= {ratio} x one-process total / N",
                        "world_size": r["world_size"], "value": r["total_per_rank"], "limit": round(limit),
                        "ratio_to_ideal": round(r["total_per_rank"] / (single / r["world_size"]), 4),
                        "met": r["total_per_rank"] <= limit})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the smoke ViT and smaller batches: a short check")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}))
    backend = "nccl" if num_gpus() >= max(h["worlds"]) else "gloo"
    t0 = time.time()
    start = record.machine()
    rows = measure(h, backend)
    from mparlib.vit import vit

    params = list(vit(h["model"]).parameters())
    full_grads, largest = 4 * sum(p.numel() for p in params), 4 * max(p.numel() for p in params)
    checked = goals(rows, h["goal_ratio"]) + peak_goals(rows, h, full_grads, largest)
    result = {
        "benchmark": "sharding",
        "claim": " ".join(__doc__.split("\n\n")[1].split()),
        "quick": args.quick,
        "hyperparameters": h,
        "backend": backend,
        "rows": rows,
        "goals": checked,
        "all_goals_met": all(g["met"] for g in checked),
        "hardware": start,
        "software": record.software(),
        "load": record.load(start),
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "sharding-quick" if args.quick else "sharding")
    print(f"vit({h['model']!r}), {backend}; bytes per rank (largest rank)")
    print(f"{'N':>2} {'params':>12} {'grads':>12} {'optimizer':>12} {'total':>12} {'median step':>12} {'min-max':>15}")
    for r in rows:
        b = r["bytes_per_rank"]
        print(f"{r['world_size']:>2} {b['params']:>12,} {b['grads']:>12,} {b['optimizer']:>12,} "
              f"{r['total_per_rank']:>12,} {1000 * r['median_step_s']:>9.1f} ms "
              f"{1000 * r['step_s']['min']:>7.1f}-{1000 * r['step_s']['max']:.1f} ms")
    print("peak bytes per rank (training state, largest rank): " + ", ".join(PEAK_METHODS))
    for r in rows:
        print(f"{r['world_size']:>2} " + " ".join(f"{r['peak_bytes_per_rank'][m]:>12,}" for m in PEAK_METHODS))
    for g in checked:
        print(f"goal N={g['world_size']}: {g['goal']}: {g['value']} (limit {g.get('limit', '-')}): "
              f"{'met' if g['met'] else 'NOT met'}")
    load = result["load"]
    print(f"load average (1 min): {load['load_1min_before']} before, {load['load_1min_after']} after, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'not busy'}")
    print(f"-> {path}")
    return 0 if result["all_goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
