"""Ring attention (context parallelism) on 1, 2 and 4 processes: attention memory per rank, time per ring step,
and the work of each rank under a causal mask with the contiguous and the balanced split.

Claims under test: (1) the attention activation bytes per rank at the longest sequence are at most 1.15 x (the
one-process bytes) / N for N = 2 and 4; (2) with the balanced causal split the slowest rank's compute time is
within 15% of the mean (the naive, contiguous split's imbalance is recorded beside it); (3) how much of the ring's
send/recv hides behind the blocks' compute is measured, not claimed.

Hardware and software: recorded in the JSON (CPU count, GPUs, torch version, commit, and `load`: the 1-minute load
average before and after the run, per core, and `busy` when it exceeds 0.3 per core).

Method: `mparlib.ring_attention`, float32, batch 8, 4 heads of width 16 (the smoke ViT's heads), sequence lengths
from Fashion-MNIST patches: 16 (7x7 patches), 196 (2x2), 784 (1x1 pixels); 49 (4x4 patches) does not split into
2 or 4 equal slices and is left out. Activation bytes = what autograd saves for the backward pass, counted with
`torch.autograd.graph.saved_tensors_hooks` (`ring_attention.SavedBytes`, every storage once), + the largest score
block that exists at one time, B x H x (T/N)^2 numbers (`measure_memory`); deterministic. For reference, one
process of `F.scaled_dot_product_attention` with the math backend and with the fused CPU kernel (saved bytes
only). Every time comes from `mparlib.timing` (`measure`, `measure_each`), the course's one way to time: a
warm-up, then at least `min_repeats` calls (rounds, where several functions are timed in turn) and `min_seconds`
of them. Times (`measure_overlap`):
the forward pass, compute alone, send/recv alone and the ring, timed in turn, round by round, each call after a
barrier, the slowest rank's time per call; median, min and max, divided by the N steps of the ring, with the load
and `busy` of the timing. Causal balance (`measure_balance`): each rank's own blocks timed without messages, the
median and min-max per rank, and the score elements each rank computes (a deterministic proxy). CPU ranks
share the cores (the launcher's default: cores // N threads each); on a machine busy with other work or with more
processes than cores, times are noisy: read them with the load average recorded beside them.

    python benchmarks/long_context.py            # lengths 16, 196, 784 on 1, 2 and 4 processes
    python benchmarks/long_context.py --quick    # the course's minimum (5 calls, 50 ms): a short check that it runs
    python benchmarks/long_context.py --threads 1   # one thread per rank (a machine busy with other work)
Writes benchmarks/results/long_context-<host>-<date>.json (long_context-quick-... with --quick).
"""
import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)
from mparlib.devices import num_gpus  # noqa: E402
from mparlib.launch import launch  # noqa: E402
from mparlib.ring_attention import SavedBytes, measure_balance, measure_memory, measure_overlap  # noqa: E402

HYPER = {
    "lengths": [16, 196, 784],
    "batch": 8,
    "heads": 4,
    "head_dim": 16,
    "worlds": [1, 2, 4],
    "min_repeats": 10,
    "min_seconds": 2.0,
    "balance_length": 784,
    "threads_per_rank": None,  # None: the launcher's default, cores // N; 1 on a machine busy with other work
    "goal_memory_ratio": 1.15,  # activation bytes per rank <= ratio x one process / N at the longest length
    "goal_balance": 1.15,  # balanced causal split: slowest rank <= 1.15 x mean compute time
}
QUICK = {"min_repeats": 5, "min_seconds": 0.05}


def sdpa_rows(h):
    """One process of PyTorch's attention: the bytes it saves for backward, math backend and fused CPU kernel."""
    rows = []
    for length in h["lengths"]:
        x = [torch.randn(h["batch"], h["heads"], length, h["head_dim"], requires_grad=True) for _ in range(3)]
        for name, backend in (("sdpa-math", SDPBackend.MATH), ("sdpa-fused", SDPBackend.FLASH_ATTENTION)):
            with sdpa_kernel(backend), SavedBytes() as saved:
                F.scaled_dot_product_attention(*x)
            rows.append({"ranks": 1, "seq_len": length, "method": name, "activation_bytes_per_rank": saved.bytes,
                         "saved_bytes_per_rank": saved.bytes, "note": "saved for backward only"})
    return rows


def run(fn, n, backend, threads, **kwargs):
    """``fn`` on ``n`` new processes, one process too, so that every world size gets the same kind of process."""
    return launch(fn, n, kwargs=kwargs, backend=backend, threads=threads, echo=False, timeout=900)


def ring_rows(h, backend):
    shape = dict(batch=h["batch"], heads=h["heads"], dim=h["head_dim"])
    rows, balance = [], {}
    for n in h["worlds"]:
        memory = run(measure_memory, n, backend, h["threads_per_rank"], lengths=tuple(h["lengths"]), **shape)
        for length in h["lengths"]:
            t = run(measure_overlap, n, backend, h["threads_per_rank"], length=length, min_repeats=h["min_repeats"],
                    min_seconds=h["min_seconds"], **shape)
            largest = max(memory, key=lambda m: m[length]["activation_bytes"])[length]
            rows.append({"ranks": n, "seq_len": length, "method": "ring",
                         "activation_bytes_per_rank": largest["activation_bytes"],
                         "saved_bytes_per_rank": largest["saved_bytes"],
                         "score_block_bytes": largest["score_block_bytes"],
                         "ms_per_step": t["ms_per_step"]["ring"][0],
                         "ms_per_step_min_max": t["ms_per_step"]["ring"][1:],
                         "compute_ms_per_step": t["ms_per_step"]["compute"],
                         "communication_ms_per_step": t["ms_per_step"]["communication"],
                         "hidden_share_of_communication": t["hidden"], "bytes_sent_per_step": t["bytes_per_step"],
                         "rounds": t["repeats"], "timing_load": t["load"]})
        if n > 1:
            balance[n] = run(measure_balance, n, backend, h["threads_per_rank"], length=h["balance_length"],
                             min_repeats=h["min_repeats"], min_seconds=h["min_seconds"], **shape)
    return rows, balance


def balance_rows(balance, h):
    rows = []
    for n, report in balance.items():
        for split, ranks in report.items():
            ms = [r["ms"] for r in ranks]
            mean = sum(ms) / len(ms)
            rows.append({"ranks": n, "seq_len": h["balance_length"], "method": f"causal-{split}",
                         "compute_ms_per_rank": ms, "slowest_over_mean": max(ms) / mean,
                         "compute_ms_min_max_per_rank": [r["ms_min_max"] for r in ranks],
                         "busy_per_rank": [r["busy"] for r in ranks],
                         "score_elements_per_rank": [r["score_elements"] for r in ranks]})
    return rows


def goals(rows, balance, h):
    longest = max(h["lengths"])
    ring = {r["ranks"]: r for r in rows if r["method"] == "ring" and r["seq_len"] == longest}
    out = []
    for n in (2, 4):
        if n in ring and 1 in ring:
            limit = h["goal_memory_ratio"] * ring[1]["activation_bytes_per_rank"] / n
            out.append({"goal": f"activation bytes per rank at T={longest} <= {h['goal_memory_ratio']} x one "
                                "process / N", "ranks": n, "value": ring[n]["activation_bytes_per_rank"],
                        "limit": round(limit), "met": ring[n]["activation_bytes_per_rank"] <= limit})
    for r in balance:
        if r["method"] == "causal-balanced":
            out.append({"goal": f"balanced causal split: slowest rank <= {h['goal_balance']} x mean compute time",
                        "ranks": r["ranks"], "value": round(r["slowest_over_mean"], 3),
                        "limit": h["goal_balance"], "met": r["slowest_over_mean"] <= h["goal_balance"]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the course's minimum timing: a short check that it runs")
    ap.add_argument("--threads", type=int, default=None, help="threads per rank (default: cores // N)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    h = dict(HYPER, **(QUICK if args.quick else {}), threads_per_rank=args.threads)
    backend = "nccl" if num_gpus() >= max(h["worlds"]) else "gloo"
    t0, start = time.time(), record.machine()
    rows, balance = ring_rows(h, backend)
    rows += sdpa_rows(h)
    balanced = balance_rows(balance, h)
    checked = goals(rows, balanced, h)
    result = {"benchmark": "long_context", "claim": " ".join(__doc__.split("\n\n")[1].split()), "quick": args.quick,
              "hyperparameters": h, "backend": backend, "rows": rows + balanced, "goals": checked,
              "all_goals_met": all(g["met"] for g in checked), "hardware": start, "software": record.software(),
              "load": record.load(start),
              "seconds": round(time.time() - t0, 1), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = record.save(result, args.out, "long_context-quick" if args.quick else "long_context")
    print(f"{'N':>2} {'T':>5} {'method':<18} {'activation/rank':>16} {'ms/step':>9}")
    for r in rows:
        ms = f"{r['ms_per_step']:9.2f}" if "ms_per_step" in r else f"{'':>9}"
        print(f"{r['ranks']:>2} {r['seq_len']:>5} {r['method']:<18} {r['activation_bytes_per_rank']:>16,} {ms}")
    for r in balanced:
        print(f"{r['ranks']:>2} {r['seq_len']:>5} {r['method']:<18} ms per rank "
              f"{[round(t, 1) for t in r['compute_ms_per_rank']]}, slowest / mean {r['slowest_over_mean']:.2f}")
    for g in checked:
        print(f"goal N={g['ranks']}: {g['value']:,} <= {g['limit']:,}: {'met' if g['met'] else 'NOT met'}")
    load = result["load"]
    print(f"load average (1 min): {load['load_1min_before']} before, {load['load_1min_after']} after, "
          f"{load['load_per_core']:.2f} per core: {'BUSY' if load['busy'] else 'not busy'}")
    print(f"-> {path}")
    return 0 if result["all_goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
