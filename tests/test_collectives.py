"""mparlib.collectives: the ring all-reduce equals dist.all_reduce, its schedule is a ring, the figures tell the truth.

Each multi-process test starts one small gloo run per world size (1 to 4 CPU processes) whose worker, defined in
this file, compares ``ring_all_reduce`` with ``dist.all_reduce`` on the same inputs in the same run, over sizes,
shapes, dtypes, messages cut in pieces, receive buffers kept by the caller and a subgroup, and checks every
collective against the picture of it in ``collective_patterns``. With two GPUs or more the same comparison runs on
the GPUs with nccl.
"""
import math

import pytest
import torch
import torch.distributed as dist

from mparlib import collectives, diagrams
from mparlib.collectives import (IN_USE, chunk_bounds, collective_patterns, fit_alpha_beta, ring_all_gather,
                                 ring_all_reduce, ring_contents, ring_reduce_scatter, ring_schedule)
from mparlib.errors import ConfigError, LaunchError
from mparlib.launch import launch
from mparlib.rendezvous import device
from mparlib.sharding import tensor_collectives


# ------------------------------------------------------------------------------------- workers (imported by ranks)

def _sizes(k):
    return sorted({0, 1, 2, k - 1, k, k + 1, 2 * k + 1, 7, 1000, 1001})


def _compare(x, group=None, **options):
    """Ring vs dist.all_reduce on copies of ``x``: (same object returned, exact, max difference, tolerance)."""
    ours, ref = x.clone(), x.clone()
    returned = ring_all_reduce(ours, group=group, **options)
    dist.all_reduce(ref, group=group)
    if x.dtype.is_floating_point:
        scale = x.abs()
        dist.all_reduce(scale, group=group)  # sum over ranks of |x|: the size of the sums' rounding errors
        k = dist.get_world_size(group)
        tolerance = (2 * (k - 1) * torch.finfo(x.dtype).eps * scale).max().item() if x.numel() else 0.0
        difference = (ours - ref).abs().max().item() if x.numel() else 0.0
    else:
        tolerance, difference = 0, (ours - ref).abs().max().item() if x.numel() else 0
    return returned is ours, torch.equal(ours, ref), difference, tolerance


def ring_cases(seed=0):
    """Every rank: ring vs all_reduce over sizes, dtypes, shapes and a subgroup; all ranks' results, as rows."""
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(seed + 1000 * rank)  # different data on every rank
    rows = []
    for n in _sizes(k):
        for dtype in (torch.float32, torch.float64, torch.int64):
            ints = torch.randint(-10**6, 10**6, (n,), generator=g).to(dtype).to(dev)
            rows.append((f"n={n} {dtype} integer values", "exact", *_compare(ints)))
            if dtype.is_floating_point:
                noise = torch.randn(n, generator=g, dtype=dtype).mul_(10.0 ** rank).to(dev)
                rows.append((f"n={n} {dtype} random", "close", *_compare(noise)))
    buffers, kept = {}, []  # the caller's receive buffers, kept across these calls
    for n in (7 * k, 1001):
        for dtype in (torch.float64, torch.int64, torch.float32):
            values = torch.randint(-10**6, 10**6, (n,), generator=g).to(dtype).to(dev)
            # 24 bytes: 3-6 elements a message, so the chunks go in pieces
            rows.append((f"n={n} {dtype} in 24-byte messages", "exact", *_compare(values, buffers=buffers,
                                                                                 piece_bytes=24)))
            kept.append(buffers.get((values.device, dtype)))  # one rank alone sends nothing and keeps nothing
    again = torch.randint(-10**6, 10**6, (1001,), generator=g).to(dev)
    rows.append(("n=1001 again, the kept int64 buffer", "exact", *_compare(again, buffers=buffers)))
    now, longest = buffers.get((again.device, torch.int64)), max(b - a for a, b in chunk_bounds(1001, k))
    reused = not buffers if k == 1 else len(buffers) == 3 and now is kept[4] and now.numel() == longest
    rows.append(("one buffer per dtype, grown once and reused", "exact", True, reused, 0, 0))
    big = torch.randint(2**40, 2**41, (5,), generator=g).to(dev)  # int64 beyond float64's exact integers
    rows.append(("int64 near 2**41", "exact", *_compare(big)))
    matrix = torch.randn(5, 3, generator=g, dtype=torch.float64).to(dev)
    rows.append(("2-D (5, 3)", "close", *_compare(matrix)))
    rows.append(("transposed (3, 5), not contiguous", "close", *_compare(matrix.t())))
    rows.append(("0-dim", "exact", *_compare(torch.tensor(float(rank + 1), device=dev))))
    if k >= 3:  # a subgroup of ranks 0 and 2: the others skip it
        members = [0, 2]
        group = dist.new_group(members)
        if rank in members:
            rows.append(("subgroup [0, 2]", "exact", *_compare(torch.arange(11, device=dev) * (rank + 1), group)))
        dist.barrier()
    gathered = [None] * k
    dist.all_gather_object(gathered, [(rank, *row) for row in rows])
    return [row for rank_rows in gathered for row in rank_rows]


def _decode(value, k):
    """The set of (rank, chunk) pieces summed into an int64 whose bit r*k+j stands for piece (r, j)."""
    return frozenset((b // k, b % k) for b in range(k * k) if (int(value) >> b) & 1)


def pattern_cases():
    """Every collective on one-hot int64 pieces; decoded, it says whose data arrived where. Rank 0 gets all ranks'."""
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    mine = torch.tensor([1 << (rank * k + j) for j in range(k)], dtype=torch.int64, device=dev)  # piece (rank, j)
    seen = {}
    t = mine.clone()
    dist.broadcast(t, src=0)
    seen["broadcast"] = t
    t = mine.clone()
    dist.reduce(t, dst=0)
    seen["reduce"] = t
    t = mine.clone()
    dist.all_reduce(t)
    seen["all_reduce"] = t
    t = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.reduce_scatter_tensor(t, mine.clone())
    seen["reduce_scatter"] = t
    t = torch.zeros(k, dtype=torch.int64, device=dev)
    dist.all_gather_into_tensor(t, mine[rank:rank + 1].clone())  # rank r contributes its piece (r, r)
    seen["all_gather"] = t
    t = torch.zeros(k, dtype=torch.int64, device=dev)
    dist.all_to_all_single(t, mine.clone())
    seen["all_to_all"] = t
    decoded = {name: [_decode(v, k) for v in value.tolist()] for name, value in seen.items()}
    gathered = [None] * k
    dist.all_gather_object(gathered, decoded)
    return gathered


REDUCE_SCATTER, ALL_GATHER = tensor_collectives()  # torch >= 2.13: the new names, else the old ones


def phase_cases(seed=0):
    """Every rank: the ring's two phases vs dist's reduce-scatter and all-gather, and the composition of the two."""
    rank, k, dev = dist.get_rank(), dist.get_world_size(), device()
    g = torch.Generator().manual_seed(seed + 7 + 1000 * rank)
    rows = []
    for per_rank in (0, 1, 3, 250):
        n = per_rank * k  # k divides n: the layout of dist.reduce_scatter_tensor
        for dtype in (torch.int64, torch.float32, torch.float64):
            if dtype.is_floating_point:
                x = torch.randn(n, generator=g, dtype=dtype).mul_(10.0 ** rank).to(dev)
            else:
                x = torch.randint(-10**6, 10**6, (n,), generator=g).to(dtype).to(dev)
            ours, ref = x.clone(), torch.empty(per_rank, dtype=dtype, device=dev)
            shard = ring_reduce_scatter(ours)
            REDUCE_SCATTER(ref, x.clone())
            rows.append(("reduce-scatter", n, str(dtype), shard.data_ptr() == ours[rank * per_rank:].data_ptr()
                         or per_rank == 0, *_close(shard, ref, x)))
            ring_all_gather(ours)  # completes the all-reduce that reduce-scatter began
            total = x.clone()
            dist.all_reduce(total)
            rows.append(("reduce-scatter + all-gather", n, str(dtype), True, *_close(ours, total, x)))
            mine = torch.zeros(n, dtype=dtype, device=dev)
            mine[rank * per_rank:(rank + 1) * per_rank] = x[:per_rank]  # rank r contributes chunk r
            gathered = torch.empty(n, dtype=dtype, device=dev)
            ALL_GATHER(gathered, x[:per_rank].clone())
            returned = ring_all_gather(mine)
            rows.append(("all-gather", n, str(dtype), returned is mine, torch.equal(mine, gathered), 0, 0))
    uneven = torch.arange(2 * k + 1, device=dev) * (rank + 1)  # chunks of different sizes: chunk_bounds' cut
    a, b = chunk_bounds(2 * k + 1, k)[rank]
    total = uneven.clone()
    dist.all_reduce(total)
    rows.append(("uneven reduce-scatter", 2 * k + 1, "int64", True,
                 torch.equal(ring_reduce_scatter(uneven.clone()), total[a:b]), 0, 0))
    gathered = [None] * k
    dist.all_gather_object(gathered, [(rank, *row) for row in rows])
    return [row for rank_rows in gathered for row in rank_rows]


def _close(ours, ref, x):
    """(exact, max difference, tolerance) of two results of a sum over the ranks of ``x``."""
    if not x.dtype.is_floating_point or ours.numel() == 0:
        return torch.equal(ours, ref), 0, 0
    scale = x.abs()
    dist.all_reduce(scale)
    k = dist.get_world_size()
    return torch.equal(ours, ref), (ours - ref).abs().max().item(), 2 * k * torch.finfo(x.dtype).eps * scale.max().item()


def refusal_cases():
    """Every rank: the ring's input check (ranks that disagree) and its guard on a buffers dict in use."""
    rank, dev = dist.get_rank(), device()
    messages = {}
    cases = {"numel": torch.ones(5 if rank == 1 else 4, device=dev),
             "int/float": torch.ones(4, dtype=torch.float32 if rank == 0 else torch.int64, device=dev),
             "float32/float64": torch.ones(4, dtype=torch.float64 if rank == 0 else torch.float32, device=dev)}
    for name, x in cases.items():
        for fn in (ring_all_reduce, ring_reduce_scatter, ring_all_gather):
            try:
                fn(x)
                messages[f"{name} {fn.__name__}"] = None
            except ConfigError as e:
                messages[f"{name} {fn.__name__}"] = str(e)
    try:
        ring_all_reduce(torch.ones(4, device=dev), buffers={IN_USE: ("another call", 1)})
        messages["in use"] = None
    except ConfigError as e:
        messages["in use"] = str(e)
    after = torch.full((3,), float(rank), device=dev)
    ring_all_reduce(after)  # the ranks are still in step after every refusal
    messages["still in step"] = after.tolist()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, messages)
    return gathered


def both(seed=0):
    """One run of all checks (a start of the ranks costs seconds)."""
    k = dist.get_world_size()
    return {"ring": ring_cases(seed), "patterns": pattern_cases(), "phases": phase_cases(seed),
            "refusals": refusal_cases() if k >= 2 else None}


# ------------------------------------------------------------------------------------------------ pure arithmetic

@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_chunks_cut_like_tensor_split_and_cover_every_element(k):
    for n in range(0, 23):
        bounds = chunk_bounds(n, k)
        sizes = [len(c) for c in torch.arange(n).tensor_split(k)]
        assert [b - a for a, b in bounds] == sizes
        assert bounds[0][0] == 0 and bounds[-1][1] == n
        assert all(bounds[i][1] == bounds[i + 1][0] for i in range(k - 1))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_the_schedule_is_a_ring_of_2k_minus_2_steps(k):
    schedule = ring_schedule(10, k)
    assert len(schedule) == 2 * (k - 1)
    assert [s.phase for s in schedule] == ["reduce-scatter"] * (k - 1) + ["all-gather"] * (k - 1)
    for step in schedule:
        for r in range(k):
            assert step.recv[r] == step.send[(r - 1) % k]  # what arrives is what the left neighbour sent
            assert step.send[r] != step.recv[r]  # a chunk is never read and overwritten in the same step
        assert sorted(step.send) == list(range(k))  # every chunk travels once per step: the load is balanced


@pytest.mark.parametrize("k", [1, 2, 3, 4, 6])
def test_the_simulated_ring_ends_with_every_sum_everywhere(k):
    states = ring_contents(k)
    everyone = frozenset(range(k))
    assert all(chunk == everyone for row in states[-1] for chunk in row)
    after_reduce_scatter = states[k - 1]
    for r in range(k):  # rank r owns the full sum of chunk r when the all-gather begins (dist.reduce_scatter_tensor)
        assert after_reduce_scatter[r][r] == everyone
        assert sum(chunk == everyone for chunk in after_reduce_scatter[r]) == 1


def test_alpha_beta_fit_recovers_known_parameters_and_stays_non_negative():
    sizes = [4096 * 4 ** i for i in range(9)]
    alpha, beta = 50e-6, 1 / 2e9
    exact = fit_alpha_beta(sizes, [alpha + n * beta for n in sizes])
    assert math.isclose(exact["alpha"], alpha, rel_tol=1e-9) and math.isclose(exact["beta"], beta, rel_tol=1e-9)
    assert max(abs(e) for e in exact["relative_errors"]) < 1e-9
    # pure bandwidth (no latency) and a decreasing time: the unconstrained fit would give a negative parameter
    assert fit_alpha_beta(sizes, [n * beta for n in sizes])["alpha"] == pytest.approx(0, abs=1e-15)
    shrinking = fit_alpha_beta([1, 2, 3], [3.0, 2.0, 1.0])
    assert shrinking["alpha"] > 0 and shrinking["beta"] == 0
    with pytest.raises(ConfigError, match="two different message sizes"):
        fit_alpha_beta([10, 10], [1.0, 2.0])


def test_bus_bandwidth_follows_the_nccl_tests_convention():
    assert collectives.bus_bandwidth(1.0, 2) == 1.0 and collectives.bus_bandwidth(4.0, 4) == 6.0
    assert collectives.bus_bandwidth(3.0, 1) == 0.0


def test_without_a_process_group_the_ring_says_how_to_run_it():
    with pytest.raises(LaunchError, match="needs a process group"):
        ring_all_reduce(torch.ones(3))
    with pytest.raises(ConfigError, match="pass a dict that you keep"):
        ring_all_reduce(torch.ones(3), buffers=[])
    with pytest.raises(ConfigError, match="piece_bytes=0"):
        ring_all_reduce(torch.ones(3), piece_bytes=0)
    for phase in (ring_reduce_scatter, ring_all_gather):
        with pytest.raises(LaunchError, match=f"{phase.__name__} needs a process group"):
            phase(torch.ones(3))
        with pytest.raises(ConfigError, match=f"{phase.__name__} needs a torch.Tensor"):
            phase([1.0, 2.0])
    with pytest.raises(ConfigError, match="n=-1"):
        chunk_bounds(-1, 2)


def test_the_module_keeps_no_state_between_calls():
    state = [n for n, v in vars(collectives).items()
             if not n.startswith("__") and isinstance(v, (dict, list, set, torch.Tensor))]
    assert not state, f"module-level containers would be shared by every call: {sorted(state)}"


@pytest.mark.parametrize("k", [2, 4])
def test_the_figures_draw_every_collective_and_every_ring_step(k):
    assert len(diagrams.collectives_figure(k).axes) == len(collective_patterns(k)) == 6
    ring = diagrams.ring_figure(k).axes[0]
    assert len(ring.patches) == len(ring_contents(k)) * k * k  # a box per chunk, rank and state


# ------------------------------------------------------------------------------------------------ processes

def _check_rows(rows, k):
    per_rank = 5 * len(_sizes(k)) + 8 + 4  # 3 dtypes of integers + 2 random per size, 8 pieces/buffers, 4 shapes
    assert len(rows) == k * per_rank + (2 if k >= 3 else 0)  # every rank ran every case (ranks 0, 2: the subgroup)
    for rank, name, kind, same_object, exact, difference, tolerance in rows:
        assert same_object, f"rank {rank}, {name}: ring_all_reduce must return the tensor it was given"
        if kind == "exact":
            assert exact, f"rank {rank}, {name}: differs from dist.all_reduce by {difference}"
        else:
            assert difference <= tolerance, f"rank {rank}, {name}: {difference} > {tolerance}"


def _check_patterns(gathered, k):
    patterns = collective_patterns(k)
    assert len(gathered) == k and set(gathered[0]) == set(patterns)
    for name, (_, after) in patterns.items():
        for r in range(k):
            expected = after[r]
            got = gathered[r][name]
            if name == "reduce_scatter":  # the output is rank r's own chunk only
                expected = [expected[r]]
            assert len(got) == len(expected)
            for j, (want, have) in enumerate(zip(expected, got)):
                if want is not None:  # None: the collective leaves that place unspecified
                    assert have == want, f"{name}, rank {r}, position {j}: {sorted(have)} != {sorted(want)}"


def _check_phases(rows, k):
    assert len(rows) == k * (4 * 3 * 3 + 1)  # 4 sizes x 3 dtypes x 3 checks, and the uneven case, on every rank
    for rank, name, n, dtype, same_object, exact, difference, tolerance in rows:
        assert same_object, f"rank {rank}, {name} n={n} {dtype}: not the rank's own chunk / tensor"
        if dtype == "torch.int64" or "all-gather" == name or "uneven" in name:
            assert exact, f"rank {rank}, {name} n={n} {dtype}: differs from torch.distributed"
        else:
            assert difference <= tolerance, f"rank {rank}, {name} n={n} {dtype}: {difference} > {tolerance}"


def _check_refusals(gathered, k):
    for rank, messages in enumerate(gathered):
        for fn in ("ring_all_reduce", "ring_reduce_scatter", "ring_all_gather"):
            numel = messages[f"numel {fn}"]
            assert numel and fn in numel and "rank(s) 1: 5 elements of torch.float32" in numel, numel
            assert f"rank(s) 0, {', '.join(map(str, range(2, k)))}" in numel or k == 2, numel
            mixed = messages[f"int/float {fn}"]
            assert mixed and "rank(s) 0: 4 elements of torch.float32" in mixed and "integer and floating" in mixed
            wide = messages[f"float32/float64 {fn}"]
            assert wide and "torch.float64" in wide and "integer and floating" not in wide
        assert messages["in use"] and "already in use" in messages["in use"]
        assert messages["still in step"] == [float(sum(range(k)))] * 3


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ring_equals_all_reduce_and_the_figure_of_each_collective_is_true(k):
    result = launch(both, k, args=(k,), backend="gloo", echo=False, timeout=120)
    _check_rows(result["ring"], k)
    _check_patterns(result["patterns"], k)
    _check_phases(result["phases"], k)
    if k >= 2:
        _check_refusals(result["refusals"], k)


@pytest.mark.gpu
def test_ring_equals_all_reduce_on_gpus_with_nccl():
    k = torch.cuda.device_count()
    if k < 2:
        pytest.skip("nccl between processes needs two GPUs or more")
    result = launch(both, k, backend="nccl", echo=False, timeout=120)
    _check_rows(result["ring"], k)
    _check_patterns(result["patterns"], k)
    _check_phases(result["phases"], k)
    _check_refusals(result["refusals"], k)
