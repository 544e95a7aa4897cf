"""Checks judged apart (mparlib.exercises.sandbox): the learner's code runs in a clean worker process, the kernel
holds the expected values and decides; the worker and all it started end at the stated limit."""
import math
import os
import signal
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch

from mparlib.exercises import check, core

NOTEBOOK = """
import math, os, signal, subprocess, sys, threading, time
import torch
"""


def notebook(code, **names):
    """The functions of ``code`` as a notebook defines them: in a module no other process can import."""
    module = types.ModuleType("a_notebook_cell")
    module.__dict__.update(names)
    exec(compile(NOTEBOOK + textwrap.dedent(code), "<cell>", "exec"), module.__dict__)
    return module


@pytest.fixture
def apart_exercise():
    """Exercise 99.2, judged apart, registered for one test with the check function the test gives."""
    def register(fn, **kwargs):
        kwargs.setdefault("hints", [("where", "どこ"), ("idea", "考え"), ("nearly", "ほぼ")])
        core.exercise("99.2", **kwargs)(fn)
        return "99.2"
    yield register
    core.REGISTRY.pop("99.2", None)
    core.SHOWN.pop("99.2", None)


def gone(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def secret_check(answer):
    """Compares the learner's value with a tensor that only this function (in the kernel) holds."""
    secret = torch.arange(7919, dtype=torch.float64) * 0.5
    got = core.call(answer)
    ok = isinstance(got, torch.Tensor) and got.shape == secret.shape and bool(torch.allclose(got, secret))
    return core.right() if ok else core.wrong("not the secret")


SEEKERS = notebook("""
def from_frames():
    import gc
    for obj in gc.get_objects():  # every object of this process, the check's frames included if they are here
        if isinstance(obj, torch.Tensor) and obj.numel() == 7919:
            return obj.clone()
    for frame in sys._current_frames().values():
        while frame is not None:
            for v in frame.f_locals.values():
                if isinstance(v, torch.Tensor) and v.numel() == 7919:
                    return v.clone()
            frame = frame.f_back
    return None

def patches_the_comparison():
    torch.allclose = lambda *a, **k: True
    torch.Tensor.abs = lambda self: torch.zeros_like(self)
    math.isclose = lambda *a, **k: True
    return torch.zeros(7919, dtype=torch.float64)
""")


def test_expected_values_held_by_the_check_are_out_of_the_answers_reach(apart_exercise):
    number = apart_exercise(secret_check)
    assert check(number, SEEKERS.from_frames).status == "wrong"
    # the same answer, its check judged in this process without a worker, finds the secret
    assert core.judge(core.REGISTRY[number], SEEKERS.from_frames, {}).status == "right"


def test_patches_made_by_the_answer_change_neither_the_verdict_nor_the_kernel(apart_exercise):
    allclose, isclose, abs_ = torch.allclose, math.isclose, torch.Tensor.abs
    assert check(apart_exercise(secret_check), SEEKERS.patches_the_comparison).status == "wrong"
    assert (torch.allclose, math.isclose, torch.Tensor.abs) == (allclose, isclose, abs_)


def test_a_forged_reply_runs_no_code_in_the_kernel(apart_exercise, tmp_path):
    marker = tmp_path / "ran-in-the-kernel"
    forger = notebook("""
    class Payload:
        def __reduce__(self):
            return (open, (MARKER, "w"))

    def forge():
        import pickle
        frame = sys._getframe()
        while "box" not in frame.f_locals:  # up to the worker's entry, which knows the reply's folder
            frame = frame.f_back
        with open(os.path.join(str(frame.f_locals["box"]), "reply.pt"), "wb") as f:
            pickle.dump({"kind": "value", "value": Payload()}, f)
        os._exit(0)
    """, MARKER=str(marker))
    outcome = check(apart_exercise(secret_check), forger.forge)
    assert outcome.status == "error" and "damaged the reply" in outcome.message
    assert not marker.exists()


def test_a_forged_reply_with_fewer_values_than_cases_is_not_a_right_answer(apart_exercise):
    """An empty list of values, forged in the worker's place: a comparison over what came back would find no case
    wrong, so the check counts what came back first."""
    forger = notebook("""
    def forge(x):
        frame = sys._getframe()
        while "box" not in frame.f_locals:  # up to the worker's entry, which knows the reply's folder
            frame = frame.f_back
        torch.save({"kind": "value", "value": []}, os.path.join(str(frame.f_locals["box"]), "reply.pt"))
        os._exit(0)  # before the worker replaces the reply with its own
    """)
    number = apart_exercise(lambda answer: core.compare_cases(answer, [(1,), (2,), (3,)], lambda x: x * 2))
    outcome = check(number, forger.forge)
    assert outcome.status == "error" and "3 results were due and 0 came back" in outcome.message


def test_the_worker_starts_clean_of_what_the_kernel_did(apart_exercise):
    seen = []
    number = apart_exercise(lambda a: seen.append(core.call(a)) or core.right())
    torch.set_default_dtype(torch.float64)
    try:
        assert check(number, notebook("def dtype():\n    return str(torch.get_default_dtype())").dtype).ok
    finally:
        torch.set_default_dtype(torch.float32)
    assert seen == ["torch.float32"]


SPINNERS = notebook("""
def never_returns():
    print("started", flush=True)
    os.write(1, b"written by C-level code\\n")
    while True:
        pass

def ignores_every_signal():
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGALRM):
        signal.signal(s, signal.SIG_IGN)
    while True:
        try:
            time.sleep(0.01)
        except BaseException:
            pass

def starts_a_session_and_spins(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    open(pid_file, "w").write(str(child.pid))
    while True:
        pass

def starts_a_session_and_returns(pid_file):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    open(pid_file, "w").write(str(child.pid))
    return 1
""")


@pytest.mark.slow
@pytest.mark.parametrize("answer", [SPINNERS.never_returns, SPINNERS.ignores_every_signal])
def test_an_answer_that_does_not_return_is_ended_at_the_limit_and_its_output_was_shown(apart_exercise, answer,
                                                                                        capsys):
    number = apart_exercise(lambda a: core.call(a) or core.right(), limit=3)
    start = time.monotonic()
    outcome = check(number, answer)
    waited = time.monotonic() - start
    assert 3 <= waited < 3 + 5
    assert outcome.status == "wrong" and outcome.hint_key == "stuck"
    assert "the limit of this exercise is 3 s" in outcome.message
    if answer is SPINNERS.never_returns:
        assert capsys.readouterr().out == "started\nwritten by C-level code\n"


@pytest.mark.slow
@pytest.mark.parametrize("answer", [SPINNERS.starts_a_session_and_spins, SPINNERS.starts_a_session_and_returns])
def test_a_process_the_answer_started_in_a_session_of_its_own_ends_with_the_check(apart_exercise, answer, tmp_path):
    pid_file = tmp_path / "pid"
    number = apart_exercise(lambda a: core.call(a, str(pid_file)) and core.right(), limit=3)
    check(number, answer)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(pid)


def test_a_crash_is_the_learners_error_with_its_signal_and_is_not_run_again(apart_exercise, tmp_path):
    runs = tmp_path / "runs"
    crasher = notebook("""
    def crash(path):
        with open(path, "a") as f:
            f.write("run\\n")
        os.kill(os.getpid(), signal.SIGSEGV)
    """)
    outcome = check(apart_exercise(lambda a: core.call(a, str(runs)) and core.right()), crasher.crash)
    assert outcome.status == "error" and "SIGSEGV" in outcome.message
    assert runs.read_text() == "run\n"


@pytest.mark.parametrize("code, said", [("def answer():\n    sys.exit(3)", "SystemExit"),
                                        ("def answer():\n    os._exit(4)", "exit code 4")])
def test_an_answer_that_ends_python_is_an_error(apart_exercise, code, said):
    outcome = check(apart_exercise(lambda a: core.call(a) or core.right()), notebook(code).answer)
    assert outcome.status == "error" and said in outcome.message


def test_a_function_that_cannot_travel_is_told_why(apart_exercise):
    answer = notebook("LOCK = threading.Lock()\ndef answer():\n    with LOCK:\n        return 1").answer
    outcome = check(apart_exercise(lambda a: core.call(a) or core.right()), answer)
    assert outcome.status == "error" and "could not be sent" in outcome.message and "lock" in outcome.message


def test_a_value_that_is_not_plain_data_comes_back_as_its_repr_and_is_wrong(apart_exercise):
    number = apart_exercise(lambda a: core.compare_cases(a, [(1,), (2,)], lambda x: [x]))
    outcome = check(number, notebook("def answer(x):\n    return (i for i in range(x))").answer)
    assert outcome.status == "wrong" and "returned <generator object" in outcome.message
    right = check(number, notebook("def answer(x):\n    return [x]").answer)
    assert right.ok and "2 cases" in right.message


def test_fifty_checks_in_a_row_in_a_process_whose_thread_pools_ran(apart_exercise):
    torch.mm(torch.randn(256, 256), torch.randn(256, 256))  # OpenMP's pool now has threads in this process
    number = apart_exercise(lambda a: core.compare_cases(a, [(2, 3), (5, 7)], lambda x, y: x * y))
    answer = notebook("def answer(x, y):\n    return int((torch.ones(x, 64) @ torch.ones(64, y)).sum().item()) // 64"
                      ).answer
    outcomes = [check(number, answer).status for _ in range(50)]
    assert outcomes == ["right"] * 50
