"""Claims of chapters 01-03 that the notebooks rely on but cannot check on every machine.

The notebooks themselves run under nbval (their assert cells prove outputs and gradients equal a single device).
These tests add what a notebook cannot: that the split simulated on the CPU is the split ``nn.DataParallel``
really makes on GPUs, that the chapters' ``torch.nn.parallel`` refusals print the same text on every machine,
and that each chapter keeps its summary and 2-4 exercises in both languages.
"""
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mparlib.parallel import data_parallel

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ["01_dataparallel", "02_wrapped_attributes", "03_primitives"]


class RowProbe(nn.Module):
    """Log which rows (row i of the batch holds the value i) each call receives."""

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        self.log.append(x[:, 0].int().tolist())
        return x


def numbered(n):
    return torch.arange(n, dtype=torch.float32).unsqueeze(1).repeat(1, 3)


def split_seen_by(run, n):
    log = []
    run(nn.Sequential(RowProbe(log), nn.Linear(3, 2)), numbered(n))
    return sorted(log)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 10, 17])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_simulated_split_follows_torch_chunk(rows, k):
    seen = split_seen_by(lambda net, x: data_parallel(net, x, ["cpu"] * k), rows)
    assert seen == [c.tolist() for c in torch.arange(rows).chunk(k)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, 5, 10, 17])
def test_the_simulated_split_is_the_split_dataparallel_makes_on_real_gpus(rows):
    k = torch.cuda.device_count()
    if k < 2:
        pytest.skip("needs 2 or more GPUs")
    real = split_seen_by(lambda net, x: nn.DataParallel(net.to("cuda:0"))(x), rows)
    simulated = split_seen_by(lambda net, x: data_parallel(net, x, ["cpu"] * k), rows)
    assert real == simulated


def test_the_refusals_chapter_03_prints_are_the_same_on_every_machine():
    """Chapter 03 compares these messages with nbval, so they must not depend on the hardware."""
    net, x = nn.Linear(4, 2), torch.randn(5, 4)
    with pytest.raises(ValueError, match="^Expected a non cpu device, but got: cpu$"):
        nn.parallel.replicate(net, ["cpu", "cpu"])
    with pytest.raises(ValueError, match="^Expected a non cpu device, but got: cpu$"):
        nn.parallel.scatter(x, ["cpu", "cpu"])
    with pytest.raises(AssertionError, match="^Gather function not implemented for CPU tensors$"):
        nn.parallel.gather([x[:3], x[3:]], "cpu")


def test_the_one_line_getattr_fails_fast_with_a_low_recursion_limit():
    """Chapter 02's expected failure: a RecursionError, whatever the machine, and the limit is restored."""

    class ForwardingDataParallel(nn.DataParallel):
        def __getattr__(self, name):
            return getattr(self.module, name)

    limit = sys.getrecursionlimit()
    with pytest.raises(RecursionError):
        sys.setrecursionlimit(200)
        try:
            ForwardingDataParallel(nn.Linear(2, 2)).anything
        finally:
            sys.setrecursionlimit(limit)
    assert sys.getrecursionlimit() == limit


def markdown_parts(name):
    """The prose of one chapter's source, per language."""
    text = (ROOT / "notebooks" / "src" / f"{name}.py").read_text(encoding="utf-8")
    parts = {"en": [], "ja": []}
    current = None
    for line in text.splitlines():
        body = line[2:] if line.startswith("# ") else line[1:] if line.startswith("#") else None
        if line.startswith("# %%"):
            current = None
        elif body is not None and body.strip() in ("<!-- en -->", "<!-- ja -->"):
            current = body.strip()[5:7]
        elif current and body is not None:
            parts[current].append(body)
    return {lang: "\n".join(lines) for lang, lines in parts.items()}


@pytest.mark.parametrize("name", CHAPTERS)
def test_each_chapter_ends_with_a_summary_and_two_to_four_exercises(name):
    parts = markdown_parts(name)
    for lang, (summary, exercises) in {"en": ("## Summary", "## Exercises"), "ja": ("## まとめ", "## 練習問題")}.items():
        prose = parts[lang]
        assert summary in prose and exercises in prose, f"{name} ({lang}) lacks its summary or exercises"
        after = prose.split(exercises, 1)[1]
        count = len(re.findall(r"^\d+\. ", after, flags=re.M))
        assert 2 <= count <= 4, f"{name} ({lang}) has {count} exercises; the course asks for 2 to 4"
