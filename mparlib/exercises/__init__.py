"""Checkable exercises: ``check("01.1", my_function)`` says right or wrong, ``hint("01.1")`` gives the next hint.

Explained in 01_dataparallel.

For learners::

    from mparlib.exercises import check, hint
    check("03.2", my_scatter)   # an Outcome, shown as the cell's result
    hint("03.2")                # prints hint level 1, then 2, 3 on later calls; hint("03.2", 2) picks a level

An outcome is one of: not attempted (the starter still raises ``NotImplementedError``), wrong (the first mismatch
and the hint for the likely mistake), error (your exception and its traceback), right, cannot run here (e.g. no
GPU), or "the check itself failed" (a fault of the check, with its traceback: never a verdict on your answer).

A check runs in a copy of the kernel's process (a fork) that is ended, with every process it started, when the
exercise's time limit has passed (30 s, 240 s for exercises on several processes): an answer that loops forever,
catches every exception or ignores signals becomes a wrong outcome, and the kernel stays usable. What the answer
prints is shown after the check. Off Linux, and in a kernel that has already used CUDA (a fork cannot use it), the
check runs in the kernel itself, with no time limit.

For authors of a chapter's checks (module ``mparlib/exercises/chNN.py``, found from the number alone)::

    from .core import exercise, call, right, wrong, first_mismatch, mismatch_text, run_ranks

    @exercise("08.2", hints=[(en, ja), (en, ja), (en, ja)], mistakes={"no_division": (en, ja)},
              needs="processes", title=(en, ja))
    def check_08_2(answer, nproc=2):
        got = call(answer, x)                     # one process: the learner's errors end the check for you
        ranks = run_ranks(answer, nproc, args=(...,), reference=module_level_fn)   # fresh processes
        ...
        return wrong(mismatch_text("rank 1's result", mm), "no_division")   # or right(), cannot_run(...)

Helpers in ``core`` (all stable): ``call(fn, *args, on_error=None, **kwargs)`` (``on_error(exc)`` may name the
mistake behind an exception), ``value(answer)``, ``compare_cases(answer, cases, reference, detectors, same)`` for
formula exercises checked at many points, ``first_mismatch(got, expected, rtol, atol)`` + ``mismatch_text(where,
mismatch)``, ``ratio(got, expected)``, ``close_enough``, ``show_call``, ``not_attempted()``, ``learner_error(exc)``,
``is_starter(fn)``, ``Stop(outcome)`` (raise it to end a check with that outcome), ``registered()``, ``lookup()``.

``run_ranks`` returns one ``RankResult(rank, value, error, reference)`` per rank; a hang ends the check within
``timeout`` (a collective's limit, 20 s) with a wrong outcome naming the waiting rank (mistake key ``"hang"``);
code still running at ``limit`` (45 s) is told to stop, and every rank is killed ``MARGIN`` (10 s) later (key
``"stuck"``). ``exercise(..., limit=s)`` sets the whole check's limit (default ``core.LIMITS`` by ``needs``).
A check function has no side effects the learner sees: it runs in the forked copy.
``value(answer)`` turns a numeric answer (or a function returning one) into a number. Keys ``"hang"``, ``"stuck"``
and ``"shape"`` have common hint texts; an exercise may override them. Statuses: ``Outcome.status`` in
``core.STATUSES``; ``Outcome.hint_key`` names the mistake. Solutions live outside the package (``solutions/``).
"""
from .core import check, hint, registered

__all__ = ["check", "hint", "registered"]
