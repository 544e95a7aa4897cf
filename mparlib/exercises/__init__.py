"""Checkable exercises: ``check("01.1", my_function)`` says right or wrong, ``hint("01.1")`` gives the next hint.

Explained in 01_dataparallel.

For learners::

    from mparlib.exercises import check, hint
    check("03.2", my_scatter)   # an Outcome, shown as the cell's result
    hint("03.2")                # the next hint level, one per call, and a word when none is left;
                                # hint("03.2", 2) picks a level

An outcome is one of: not attempted (the starter still raises ``NotImplementedError``), wrong (the first mismatch
and the hint for the likely mistake), error (your exception and its traceback), right, cannot run here (e.g. no
GPU), or "the check itself failed" (a fault of the check, with its traceback: never a verdict on your answer). It
shows one hint: the likely mistake's, else level 1; the others come one at a time from ``hint``.

Every exercise is judged apart: the check runs in the kernel, and your code in a new
worker process that starts clean (forked from the fork server of :mod:`mparlib.launch`, which has imported PyTorch
and nothing of the kernel) and sends back plain data only (:mod:`~mparlib.exercises.sandbox`). Nothing your code
does there reaches the check's expected values or its verdict, and the worker, with everything it started, is ended
at the exercise's time limit (30 s; 240 s for a distributed one): an answer that loops forever, catches every
exception or ignores signals becomes a wrong outcome, and the kernel stays usable. What your code prints is shown as
it runs (rank 0's, for a distributed one). A distributed exercise's ranks are forked from that worker, on 2 and then 3
processes (2 and 4 for 10.1), so a hard-coded world size is wrong; the check computes the expected values itself,
never in a rank. No check forks the kernel, and none retries: a crash is your outcome, with its signal named.

Importing this package in a notebook also registers the ``%%worker`` cell magic (as ``%load_ext mparlib.launch``
does), so that the Exercises section of a chapter works in a kernel that was just restarted.

For authors of a chapter's checks (module ``mparlib/exercises/chNN.py``, found from the number alone)::

    from .core import exercise, call, right, wrong, first_mismatch, mismatch_text
    from .ch06 import run_children

    @exercise("08.2", hints=[(en, ja), (en, ja), (en, ja)], mistakes={"no_division": (en, ja)},
              needs="processes", title=(en, ja))
    def check_08_2(answer):
        got = call(answer, x)                     # one process: the learner's errors end the check for you
        runs = run_children(answer, child, [(2, args), (3, args)])   # fresh processes: each rank's value
        ...
        return wrong(mismatch_text("rank 1's result", mm), "no_division")   # or right(), cannot_run(...)

Helpers in ``core`` (all stable): ``call(fn, *args, on_error=None, **kwargs)`` (``on_error(exc)`` may name the
mistake behind an exception; judged apart, it runs ``fn`` in a worker and returns plain data), ``in_worker(driver,
*args)`` (a module-level ``driver`` of the check's module that builds what the learner's code works on, calls it
through ``call`` and returns what the check must see: outputs, gradients, the state it left), ``value(answer)``,
``as_number(got)``, ``compare_cases(answer, cases, reference, detectors, same)`` for
formula exercises checked at many points, ``first_mismatch(got, expected, rtol, atol)`` + ``mismatch_text(where,
mismatch)``, ``ratio(got, expected)``, ``close_enough``, ``show_call``, ``not_attempted()``, ``learner_error(exc)``,
``is_starter(fn)``, ``Stop(outcome)`` (raise it to end a check with that outcome), ``registered()``, ``lookup()``.

``run_children`` (in ``ch06``) runs a module-level ``child(module, name, *args)`` of the check's module on every
rank, which imports the learner's function, calls it on inputs it builds, and returns what the learner's code gave
or left (never an expected value: the learner's code shares its process); the check compares in the kernel. Under
it, ``run_ranks`` returns one ``RankResult(rank, value, error)`` per rank; a hang ends the check within
``timeout`` (a collective's limit, 20 s) with a wrong outcome naming the waiting rank (mistake key ``"hang"``);
code still running at ``limit`` (45 s) is told to stop, and every rank is killed ``MARGIN`` (10 s) later (key
``"stuck"``). ``exercise(..., limit=s)`` sets the whole check's limit (default ``core.LIMITS`` by ``needs``).
A check function has no side effects the learner sees: the learner's code gets the check's objects as copies in
its worker, and the kernel's global generator is as it was before the check (``torch.random.fork_rng``).
``value(answer)`` turns a numeric answer (or a function returning one) into a number. Keys ``"hang"``, ``"stuck"``
and ``"shape"`` have common hint texts; an exercise may override them. Statuses: ``Outcome.status`` in
``core.STATUSES``; ``Outcome.hint_key`` names the mistake. Solutions live outside the package (``solutions/``).
"""
from .core import check, hint, registered


def _register_worker_magic():
    """``%%worker`` in the kernel that imports this package (a no-op outside IPython)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None:
        from ..workers import register_magic

        register_magic(shell)


_register_worker_magic()

__all__ = ["check", "hint", "registered"]
