"""How long `mparlib.launch.launch` takes to run a worker that does almost nothing: the cost of starting the ranks.

Claim (chapter 06): forking the ranks from a fork server that has imported PyTorch once makes a launch after the
first several times faster than spawning fresh interpreters, each of which imports PyTorch again; the first launch
pays for starting the server.

Measures, in one run, the wall time of `launch(rank_sum, n)` for n = 2, 4 and 8 ranks (gloo on the CPU: each rank
joins the group, all-reduces one number and returns), with the ranks started by `spawn` and by the fork server
(`forkserver`, launch's default where the platform has it), method by method in turn, round by round, so that load
from other processes on a shared machine hits both alike. Reported per method and n: median, quartiles, fastest;
the ratio spawn / forkserver of the medians; and the first fork-server launch of the run (it starts the server).
Hardware, software, machine load and the git commit are saved in benchmarks/results/launch_start-HOST-TIME.json.

Run: .venv/bin/python benchmarks/launch_start.py [--repeats 7]
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from launch_workers import rank_sum  # noqa: E402  (tests/launch_workers.py: the workers the launch tests use)
from mparlib import launch  # noqa: E402
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)

RANKS = (2, 4, 8)


def timed(n):
    start = time.perf_counter()
    assert launch.launch(rank_sum, n, echo=False) == n * (n - 1) / 2
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    repeats = parser.parse_args().repeats
    start_machine = record.machine()
    first = timed(2)  # launch's own choice: the fork server starts here
    default = launch._start_method()
    methods = {"spawn": lambda: "spawn", default: launch._start_method}
    times = {m: {n: [] for n in RANKS} for m in methods}
    own = launch._start_method
    try:
        for _ in range(repeats):
            for n in RANKS:
                for method, choose in methods.items():
                    launch._start_method = choose
                    times[method][n].append(timed(n))
    finally:
        launch._start_method = own

    def summary(xs):
        q = statistics.quantiles(xs, n=4)
        return {"median_s": statistics.median(xs), "q1_s": q[0], "q3_s": q[2], "fastest_s": min(xs), "runs": xs}

    result = {
        "claim": __doc__.splitlines()[2].strip() + " " + " ".join(l.strip() for l in __doc__.splitlines()[3:5]),
        "default_start_method": default, "first_launch_2_ranks_s": first, "repeats": repeats,
        "per_method": {m: {str(n): summary(times[m][n]) for n in RANKS} for m in methods},
        "spawn_over_default_median": {str(n): statistics.median(times["spawn"][n]) / statistics.median(times[default][n])
                                      for n in RANKS},
        "machine": start_machine, "software": record.software(), "load": record.load(start_machine),
    }
    for n in RANKS:
        print(f"{n} ranks: spawn {result['per_method']['spawn'][str(n)]['median_s']:.3f} s, "
              f"{default} {result['per_method'][default][str(n)]['median_s']:.3f} s "
              f"({result['spawn_over_default_median'][str(n)]:.1f}x)")
    print(f"first launch (starts the fork server): {first:.2f} s; load per core {result['load']['load_per_core']}")
    print(record.save(result, ROOT / "benchmarks" / "results", "launch_start"))


if __name__ == "__main__":
    main()
