"""Memory per rank of FSDP2 on 1, 2 and 4 processes, and the time of its training steps.

Claim under test: with `fully_shard` on every transformer block and at the root, the parameters, gradients and
Adam state that each rank holds add up to at most 1.15 x (the one-process total) / N for N = 2 and 4 (chapter 9's
goal; the excess is FSDP2's padding of each parameter's first dimension to a multiple of N). Step times are
recorded beside the memory: sharding trades memory for communication, and on CPU processes with gloo the
all-gathers and reduce-scatters of every block are not free.

Hardware and software: recorded in the JSON (CPU count, GPUs, load average at the start, torch version, commit).

Method: the chapter's ViT (`mparlib.vit`, size "small": 3.2 M parameters), Adam, each rank a random batch of
`batch_per_rank` Fashion-MNIST-shaped images (memory and time do not depend on the pixels). The worker is
`mparlib.sharding.fsdp_memory_worker`: bytes are counted from each rank's tensors (`sharding.held_bytes`: a
DTensor's local shard, every storage once, padding included) right after the last optimizer step, while
parameters, gradients and optimizer state all exist; the largest rank's count is reported for each part, and
every rank's in `per_rank`. On GPUs `torch.cuda.max_memory_allocated` is recorded per rank too. Each step starts
after a barrier and ends after CUDA synchronisation; `warmup` steps are not timed; the slowest rank's time counts.
CPU ranks share the cores (the launcher's default: cores // N threads each, recorded as `threads_per_rank`); on a
machine busy with other work, several threads per rank can wait on each other badly, so read times from a quiet
machine.
All world sizes use the same backend: nccl when there is a GPU for each process of the largest world, else gloo.

    python benchmarks/sharding.py            # vit("small") on 1, 2 and 4 processes
    python benchmarks/sharding.py --quick    # vit("smoke"), one timed step: a short check that it all runs
Writes benchmarks/results/sharding-<host>-<date>.json (sharding-quick-... with --quick).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib.devices import num_gpus  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.launch import launch  # noqa: E402
from mparlib.sharding import fsdp_memory_worker  # noqa: E402

HYPER = {
    "model": "small",  # mparlib.vit size
    "batch_per_rank": 8,
    "warmup": 1,
    "steps": 5,
    "lr": 1e-3,
    "worlds": [1, 2, 4],
    "goal_ratio": 1.15,  # params + grads + optimizer per rank <= goal_ratio x one-process total / N
}
QUICK = {"model": "smoke", "batch_per_rank": 4, "warmup": 1, "steps": 1}


def measure(h, backend):
    rows = []
    for n in h["worlds"]:
        r = launch(fsdp_memory_worker, n, kwargs=dict(size=h["model"], batch=h["batch_per_rank"], steps=h["steps"],
                                                      warmup=h["warmup"], lr=h["lr"]),
                   backend=backend, echo=False, timeout=600)
        total = sum(r["bytes_per_rank"].values())
        rows.append({"world_size": n, "device": r["device"], "threads_per_rank": r["threads"],
                     "bytes_per_rank": r["bytes_per_rank"],
                     "total_per_rank": total, "per_rank": r["per_rank"], "step_s": r["step_s"],
                     "median_step_s": statistics.median(r["step_s"]),
                     "collectives_per_step": r["collectives_per_step"]})
    return rows


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
    ap.add_argument("--quick", action="store_true", help="the smoke ViT and one timed step: a short check")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}))
    backend = "nccl" if num_gpus() >= max(h["worlds"]) else "gloo"
    t0 = time.time()
    start = record.machine()
    rows = measure(h, backend)
    checked = goals(rows, h["goal_ratio"])
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
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "sharding-quick" if args.quick else "sharding")
    print(f"vit({h['model']!r}), {backend}; bytes per rank (largest rank)")
    print(f"{'N':>2} {'params':>12} {'grads':>12} {'optimizer':>12} {'total':>12} {'median step':>12}")
    for r in rows:
        b = r["bytes_per_rank"]
        print(f"{r['world_size']:>2} {b['params']:>12,} {b['grads']:>12,} {b['optimizer']:>12,} "
              f"{r['total_per_rank']:>12,} {1000 * r['median_step_s']:>9.1f} ms")
    for g in checked:
        print(f"goal N={g['world_size']}: {g['value']:,} <= {g['limit']:,} ({g['ratio_to_ideal']:.3f} x 1/N): "
              f"{'met' if g['met'] else 'NOT met'}")
    print(f"-> {path}")
    return 0 if result["all_goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
