"""What an all-reduce costs here: the backend's own all_reduce, the ring built from send/recv, the alpha-beta model.

Claims under test: (1) the ring all-reduce built from point-to-point messages alone
(mparlib.collectives.ring_all_reduce) takes at most 2x the time of the backend's own dist.all_reduce for messages of
16 MiB and more on 2 ranks, measured in the same run; (2) the latency-bandwidth model t = alpha + n * beta, fitted
to the measured dist.all_reduce times from 64 KiB to 256 MiB (least squares on relative errors), predicts every
one of them within 25%, on every world size measured.

Hardware and software: recorded in the JSON (CPU count, GPUs, backend, torch version, git commit, the 1-minute load
average before and after the run and per point, and `busy` when it exceeds 0.3 per core: on a machine shared with
other work the times are noisy, and such a run is marked, never called quiet).

Method: float32 messages from 64 KiB to 256 MiB (sizes x4 apart) on 2 and 4 ranks: CPU processes with gloo, or one
process per GPU with nccl where the machine has a GPU for each. Every point is timed by mparlib.timing.measure
(through mparlib.collectives.time_collective): `warmup` untimed calls, then timed calls until they add up to at least
`min_seconds` and number at least `min_repeats`; the ranks meet at a barrier before each call, the clock is read
after CUDA has finished, a call's time is the slowest rank's, and the median is reported with its spread (min, max,
quartiles). Algorithm bandwidth = bytes / median time; bus bandwidth = algorithm bandwidth x 2(k-1)/k (the
nccl-tests convention). The ring keeps its receive buffers for the whole run (mparlib.collectives.bandwidth_worker
holds them, as the backend holds its own) and skips its input check, one extra small all-gather per call.

    python benchmarks/collectives.py            # the measurement (a minute or two on 2 cores)
    python benchmarks/collectives.py --quick    # a short check: 3 sizes up to 16 MiB
    python benchmarks/collectives.py --backend gloo --world-sizes 2   # CPU processes only, on 2 ranks
Writes benchmarks/results/collectives-<host>-<date>.json.
"""
import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mparlib import collectives  # noqa: E402
from mparlib.devices import num_gpus  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.errors import MparlibError  # noqa: E402
from mparlib.launch import launch  # noqa: E402
from mparlib.rendezvous import choose_backend  # noqa: E402

KiB, MiB = 1024, 1024 ** 2
HYPER = {
    "sizes": [64 * KiB * 4 ** i for i in range(7)],  # 64 KiB .. 256 MiB
    "world_sizes": [2, 4],
    "methods": ["all_reduce", "ring"],
    "warmup": 1,
    "min_seconds": 0.05,  # per point: timed calls until they add up to this ...
    "min_repeats": 5,  # ... and number at least this
    "goal_ring_ratio": 2.0,  # ring time / all_reduce time, at most, for sizes >= goal_ring_min_bytes on 2 ranks
    "goal_ring_min_bytes": 16 * MiB,
    "goal_fit_error": 0.25,  # |model - measured| / measured, at most, for sizes >= goal_fit_min_bytes
    "goal_fit_min_bytes": 64 * KiB,
}
QUICK = {"sizes": [64 * KiB, 1 * MiB, 16 * MiB]}


def goals(h, rows, fits):
    """Whether each goal was met (None: not measured in this run), with the numbers it was judged on."""
    by = {(r["world_size"], r["method"], r["bytes"]): r["seconds"] for r in rows}
    ratios = {str(n): by[(2, "ring", n)] / by[(2, "all_reduce", n)] for n in h["sizes"]
              if n >= h["goal_ring_min_bytes"] and (2, "ring", n) in by and (2, "all_reduce", n) in by}
    errors = {}
    for k, fit in fits.items():
        sizes = [n for n in h["sizes"] if (k, "all_reduce", n) in by]
        errors[str(k)] = {str(n): e for n, e in zip(sizes, fit["relative_errors"]) if n >= h["goal_fit_min_bytes"]}
    worst = max((abs(e) for per_k in errors.values() for e in per_k.values()), default=None)
    return {
        "ring_within_2x_of_all_reduce_on_2_ranks": {
            "target": f"ring / all_reduce <= {h['goal_ring_ratio']} for messages >= {h['goal_ring_min_bytes']} bytes",
            "ratios": ratios, "met": max(ratios.values()) <= h["goal_ring_ratio"] if ratios else None},
        "alpha_beta_model_within_25_percent": {
            "target": f"|relative error| <= {h['goal_fit_error']} for messages >= {h['goal_fit_min_bytes']} bytes",
            "relative_errors": errors, "worst": worst, "met": worst <= h["goal_fit_error"] if worst is not None else None},
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a short check: 3 sizes up to 16 MiB")
    ap.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                    help="auto: nccl where there is a GPU per rank, else gloo on the CPU")
    ap.add_argument("--world-sizes", type=int, nargs="+", default=HYPER["world_sizes"], metavar="K")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}), quick=args.quick, backend=args.backend,
             world_sizes=args.world_sizes)
    t0 = time.time()
    start = record.machine()
    software = record.software(nccl=".".join(map(str, torch.cuda.nccl.version())) if num_gpus() else None)  # measured
    rows, fits, fits_min, backends = [], {}, {}, {}
    for k in h["world_sizes"]:
        try:
            backends[k] = choose_backend(h["backend"], k)
        except MparlibError as e:  # e.g. nccl asked for more ranks than there are GPUs
            print(f"error: {e}", file=sys.stderr)
            return 2
        rows += launch(collectives.bandwidth_worker, k, args=(h["sizes"],), backend=backends[k],
                       kwargs=dict(methods=h["methods"], warmup=h["warmup"], min_seconds=h["min_seconds"],
                                   min_repeats=h["min_repeats"]), echo=False)
        measured = [r for r in rows if r["world_size"] == k and r["method"] == "all_reduce"]
        fits[k] = collectives.fit_alpha_beta([r["bytes"] for r in measured], [r["seconds"] for r in measured])
        # the fastest call of each point: the least disturbed by other work (the goal is judged on the medians)
        fits_min[k] = collectives.fit_alpha_beta([r["bytes"] for r in measured], [r["min"] for r in measured])
    result = {
        "benchmark": "collectives",
        "claim": " ".join(__doc__.split("\n\n")[1].split()),
        "hyperparameters": h,
        "rows": rows,
        "alpha_beta": {str(k): {"alpha_s": f["alpha"], "beta_s_per_byte": f["beta"], "bandwidth_bytes_per_s":
                                f["bandwidth"], "relative_errors": f["relative_errors"],
                                "relative_error_by_bytes": {str(r["bytes"]): e for r, e in zip(
                                    [r for r in rows if r["world_size"] == k and r["method"] == "all_reduce"],
                                    f["relative_errors"])}} for k, f in fits.items()},
        "alpha_beta_of_fastest_calls": {str(k): {"alpha_s": f["alpha"], "beta_s_per_byte": f["beta"],
                                                 "relative_errors": f["relative_errors"]} for k, f in fits_min.items()},
        "goals": goals(h, rows, fits),
        "hardware": start | {"backends": {str(k): b for k, b in backends.items()}},
        "load": record.load(start),
        "software": software,
        "seconds": round(time.time() - t0, 1),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path = record.save(result, args.out, "collectives")
    print(f"{'ranks':>5} {'backend':>7} {'method':>10} {'bytes':>11} {'median ms':>10} {'min ms':>8} {'max ms':>8} "
          f"{'calls':>5} {'busbw GB/s':>10} {'fit error':>9}")
    errors = {(r["world_size"], r["bytes"]): e for k, f in fits.items() for r, e in zip(
        [r for r in rows if r["world_size"] == k and r["method"] == "all_reduce"], f["relative_errors"])}
    for r in rows:
        error = errors.get((r["world_size"], r["bytes"])) if r["method"] == "all_reduce" else None
        print(f"{r['world_size']:>5} {r['backend']:>7} {r['method']:>10} {r['bytes']:>11} {r['seconds'] * 1e3:>10.3f} "
              f"{r['min'] * 1e3:>8.3f} {r['max'] * 1e3:>8.3f} {r['repeats']:>5} {r['busbw'] / 1e9:>10.3f} "
              f"{'' if error is None else f'{error:+.0%}':>9}")
    for k, f in fits.items():
        g = fits_min[k]
        print(f"alpha-beta, {k} ranks: alpha {f['alpha'] * 1e6:.1f} us, bandwidth {f['bandwidth'] / 1e9:.3f} GB/s "
              f"(fastest calls: alpha {g['alpha'] * 1e6:.1f} us, bandwidth {g['bandwidth'] / 1e9:.3f} GB/s, worst error "
              f"{max(abs(e) for e in g['relative_errors']):.0%})")
    load = result["load"]
    print(f"load average (1 min): {load['load_1min_before']} before, {load['load_1min_after']:.2f} after, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'quiet'}")
    for name, g in result["goals"].items():
        print(f"goal {name}: {'not measured' if g['met'] is None else 'met' if g['met'] else 'NOT met'}")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
