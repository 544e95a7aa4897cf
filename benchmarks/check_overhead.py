"""What judging an exercise apart costs: a check whose answer runs in a fresh worker, against the same check in-process.

Claim (issue: exercise checks that no answer can fool): running the learner's code in a clean worker process (forked
from launch's fork server, results back as plain data) adds at most 2 s to a check on a 2-core machine; the first
check of a kernel also pays for starting the fork server.

Measures, in a Jupyter kernel of the course (the place learners run checks; nbclient starts it), the wall time of
``check(number, solution)`` judged apart and of the same check function run in the kernel with the learner's code
called directly (``core.judge`` with nothing apart: no process, no limit), exercise by exercise in turn, round by
round, for 01.1 (40 cases in one worker), 01.3 (a driver: one SGD step through data_parallel), 03.2 (outputs and
gradients of three cases, three workers) and 06.1 (distributed: 2 and then 3 ranks, forked from the check's worker
when apart, started from the kernel's fork server when not). Reported per exercise: medians, quartiles and the overhead (the difference
of the medians); and the first check of the kernel. Hardware, software, load and the git commit are saved in
benchmarks/results/check_overhead-HOST-TIME.json.

Run: .venv/bin/python benchmarks/check_overhead.py [--repeats 9]
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import record  # noqa: E402  (benchmarks/record.py: machine, software, commit, saving)

NUMBERS = ("01.1", "01.3", "03.2", "06.1")

KERNEL_CODE = """
import json, statistics, sys, time
sys.path.insert(0, {root!r})
from mparlib.exercises import check, core
from solutions.ch01 import SOLUTIONS as S1
from solutions.ch03 import SOLUTIONS as S3
from solutions.ch06 import SOLUTIONS as S6
answers = {{**S1, **S3, **S6}}
start = time.perf_counter()
assert check("01.1", answers["01.1"]).ok
first = time.perf_counter() - start
times = {{n: {{"apart": [], "in_process": []}} for n in {numbers!r}}}
for _ in range({repeats}):
    for n in {numbers!r}:
        start = time.perf_counter()
        assert check(n, answers[n]).ok
        times[n]["apart"].append(time.perf_counter() - start)
        ex = core.lookup(n)
        start = time.perf_counter()
        assert core.judge(ex, answers[n], {{}}).ok
        times[n]["in_process"].append(time.perf_counter() - start)
print(json.dumps({{"first_check_s": first, "times": times}}))
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    repeats = parser.parse_args().repeats
    start_machine = record.machine()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        KERNEL_CODE.format(root=str(ROOT), numbers=NUMBERS, repeats=repeats))])
    NotebookClient(notebook, kernel_name="mparlib", timeout=900,
                   resources={"metadata": {"path": str(ROOT / "notebooks" / "en")}}).execute()
    out = json.loads(next(o["text"] for o in notebook.cells[0].outputs if o.get("name") == "stdout"))

    def summary(xs):
        q = statistics.quantiles(xs, n=4)
        return {"median_s": statistics.median(xs), "q1_s": q[0], "q3_s": q[2], "runs": xs}

    per = {n: {way: summary(xs) for way, xs in out["times"][n].items()} for n in NUMBERS}
    overhead = {n: per[n]["apart"]["median_s"] - per[n]["in_process"]["median_s"] for n in NUMBERS}
    result = {
        "claim": " ".join(line.strip() for line in __doc__.splitlines()[2:5]),
        "first_check_s": out["first_check_s"], "repeats": repeats, "per_exercise": per,
        "overhead_median_s": overhead, "within_2_s": all(v <= 2.0 for v in overhead.values()),
        "machine": start_machine, "software": record.software(), "load": record.load(start_machine),
    }
    for n in NUMBERS:
        print(f"{n}: apart {per[n]['apart']['median_s']:.3f} s, in the kernel {per[n]['in_process']['median_s']:.3f} s, "
              f"overhead {overhead[n]:.3f} s")
    print(f"first check of the kernel (starts the fork server): {out['first_check_s']:.2f} s; "
          f"load per core {result['load']['load_per_core']}")
    print(record.save(result, ROOT / "benchmarks" / "results", "check_overhead"))


if __name__ == "__main__":
    main()
