"""The language switch and the timing helpers (chapter 00_setup)."""
import sys
import time

import pytest

import mparlib.lang
from mparlib.errors import ConfigError, DeviceError
from mparlib.timing import Timer

lang_mod = mparlib.lang


def test_import_gives_the_module():
    assert sys.modules["mparlib.lang"] is mparlib.lang and callable(mparlib.lang.tr)


def test_language_follows_the_notebook_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("MPARLIB_LANG", raising=False)
    for name in ("en", "ja"):
        (tmp_path / "notebooks" / name).mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "notebooks" / "ja")
    assert lang_mod.language() == "ja" and lang_mod.tr("Epoch", "エポック") == "エポック"
    monkeypatch.chdir(tmp_path / "notebooks" / "en")
    assert lang_mod.language() == "en" and lang_mod.tr("Epoch", "エポック") == "Epoch"
    monkeypatch.chdir(tmp_path)
    assert lang_mod.language() == "en"


def test_environment_variable_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert lang_mod.language() == "ja"
    monkeypatch.setenv("MPARLIB_LANG", "fr")
    with pytest.raises(ValueError, match="not a course language"):
        lang_mod.language()


def test_timer_measures_laps():
    timer = Timer()
    for _ in range(2):
        with timer:
            time.sleep(0.02)
    assert len(timer.times) == 2
    assert all(0.015 < t < 1.0 for t in timer.times)
    assert timer.sum() == pytest.approx(sum(timer.times))
    assert timer.cumsum()[-1] == pytest.approx(timer.sum())
    assert timer.avg() == pytest.approx(timer.sum() / 2)


def test_timer_stop_without_start_is_a_clear_error():
    with pytest.raises(ConfigError, match="before Timer.start"):
        Timer().stop()
    with pytest.raises(ConfigError, match="no lap was recorded yet"):
        Timer().avg()


def test_timer_synchronises_cuda_before_reading_the_clock(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    with Timer():
        pass
    assert calls == [None, None]  # before start and before stop, on every GPU
    with Timer("cpu"):
        pass
    assert calls == [None, None]  # a timer of the CPU has nothing to wait for


def test_timer_checks_its_device_once_when_it_is_made(monkeypatch):
    import mparlib.timing

    checked = []
    real = mparlib.timing.check_device
    monkeypatch.setattr(mparlib.timing, "check_device", lambda device, what: checked.append(device) or real(device, what))
    timer = Timer("cpu")
    for _ in range(3):
        with timer:
            pass
    assert checked == ["cpu"] and len(timer.times) == 3


def test_matmul_tflops_is_a_positive_measured_rate():
    import torch

    from mparlib.timing import matmul_tflops

    small, large = matmul_tflops("cpu", torch.float32, n=64, repeats=2), matmul_tflops("cpu", torch.float32, n=256)
    assert 0 < small < 1e3 and 0 < large < 1e3


def test_timing_helpers_refuse_bad_devices_and_sizes():
    import torch

    from mparlib.timing import matmul_tflops, synchronize

    for call in (lambda: synchronize("tpu"), lambda: Timer("tpu"), lambda: matmul_tflops("tpu")):
        with pytest.raises(DeviceError, match="'tpu' is not a device"):
            call()
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    with pytest.raises(DeviceError, match=f"{missing} does not exist"):
        synchronize(missing)
    for kw, match in (({"n": 0}, "n=0"), ({"repeats": True}, "repeats=True"), ({"dtype": torch.int64}, "dtype=")):
        with pytest.raises(ConfigError, match=match):
            matmul_tflops("cpu", **kw)


class FakeClock:
    """A clock that moves only when the timed function says so: repeat counts follow from the rules alone."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _timed(clock, durations):
    """A function whose n-th call takes durations[n] seconds of the fake clock (the last one repeated)."""
    calls = []

    def fn():
        clock.now += durations[min(len(calls), len(durations) - 1)]
        calls.append(clock.now)

    return fn, calls


def test_measure_repeats_until_both_the_minimum_count_and_the_minimum_duration():
    from mparlib.timing import measure

    clock = FakeClock()
    fn, calls = _timed(clock, [0.001])  # 1 ms a call: 50 ms need 50 timed calls
    t = measure(fn, warmup=2, min_seconds=0.05, min_repeats=5, clock=clock, load=lambda: 0.0, cores=2)
    assert len(t.times) == 50 and len(calls) == 52  # 2 warm-up calls, untimed
    clock = FakeClock()
    fn, calls = _timed(clock, [0.2])  # slow calls: the count decides
    t = measure(fn, warmup=1, min_seconds=0.05, min_repeats=5, clock=clock, load=lambda: 0.0, cores=2)
    assert len(t.times) == 5 and len(calls) == 6 and t.median == pytest.approx(0.2)
    clock = FakeClock()
    fn, calls = _timed(clock, [1e-6])
    t = measure(fn, warmup=0, min_seconds=10.0, min_repeats=3, max_repeats=7, clock=clock, load=lambda: 0.0)
    assert len(t.times) == 7  # the cap wins over the minimum duration


def test_measure_honours_the_minimum_duration_with_a_real_clock():
    from mparlib.timing import measure

    t = measure(lambda: time.sleep(0.004), warmup=1, min_seconds=0.03, min_repeats=2)
    assert sum(t.times) >= 0.03 and len(t.times) >= 2


def test_timing_spread_is_ordered_and_the_median_is_the_middle():
    from mparlib.timing import Timing

    t = Timing((0.5, 0.1, 0.3, 0.2, 0.4, 1.0), 0.0, 0.0, 1)
    q1, q3 = t.quartiles
    s = t.summary()
    assert s["min"] == 0.1 <= q1 <= s["median"] <= q3 <= s["max"] == 1.0
    assert s["median"] == pytest.approx(0.35) and s["iqr"] == pytest.approx(q3 - q1) and s["repeats"] == 6
    one = Timing((0.25,))
    assert one.quartiles == (0.25, 0.25) and one.iqr == 0 and one.median == 0.25
    with pytest.raises(ConfigError, match="at least one non-negative time"):
        Timing(())


def test_busy_flag_follows_the_load_per_core():
    from mparlib.timing import Timing, measure

    assert not Timing((1.0,), 0.5, 0.5, 2).busy  # 0.25 per core
    assert Timing((1.0,), 0.2, 0.7, 2).busy  # the load after the timing counts too: 0.35 per core
    assert Timing((1.0,), 3.0, 1.0, 16).busy is False and Timing((1.0,), None, None, 2).busy is False
    assert Timing((1.0,), 1.0, 1.0, 4, busy_per_core=0.2).busy
    loads = iter([0.1, 1.9])  # before and after
    clock = FakeClock()
    fn, _ = _timed(clock, [0.1])
    t = measure(fn, clock=clock, load=lambda: next(loads), cores=2)
    assert (t.load_before, t.load_after, t.busy) == (0.1, 1.9, True)
    assert t.summary()["busy"] is True and t.summary()["load_after"] == 1.9


def test_measure_agrees_across_ranks_through_its_hook():
    from mparlib.timing import measure

    clock, decisions = FakeClock(), []
    fn, _ = _timed(clock, [0.001])

    def across(values):  # stands for a MAX all-reduce: another rank wants 8 calls, and was slower on each
        if len(values) == 1:
            decisions.append(values[0])
            return [1.0] if len(decisions) < 8 else values
        return [v * 2 for v in values]

    t = measure(fn, warmup=0, min_seconds=0.0, min_repeats=3, clock=clock, load=lambda: 0.0, across=across)
    assert len(t.times) == 8 and decisions[:3] == [1.0, 1.0, 0.0] and t.median == pytest.approx(0.002)


def test_measure_refuses_bad_settings():
    from mparlib.timing import measure

    for kw, match in (({"min_repeats": 0}, "min_repeats=0"), ({"min_seconds": -1}, "min_seconds=-1"),
                      ({"warmup": -1}, "warmup=-1"), ({"max_repeats": 2, "min_repeats": 3}, "max_repeats=2")):
        with pytest.raises(ConfigError, match=match):
            measure(lambda: None, **kw)


def test_tables_are_padded_by_display_width():
    from mparlib.lang import display_width, pad

    assert display_width("abc") == 3 and display_width("方法") == 4 and display_width("ｱ") == 1  # half-width kana
    assert display_width("（未定義）") == 10 and display_width("e\u0301") == 1  # full-width brackets; a combining accent
    rows = [pad(label, 16) + "|" for label in ("way", "方法", "マイクロバッチ")]
    assert len({display_width(row) for row in rows}) == 1  # the bars line up
    assert pad("12", 5, ">") == "   12" and pad("長すぎる見出し", 4) == "長すぎる見出し"  # never cut
    with pytest.raises(ConfigError, match="align"):
        pad("x", 3, "^")


def test_report_speaks_the_editions_language(monkeypatch):
    import mparlib

    monkeypatch.setenv("MPARLIB_LANG", "ja")
    text = mparlib.report()
    assert "CPU スレッド数" in text and "GPU の数" in text and "プロファイル" in text and "CPU threads" not in text
    from mparlib.lang import display_width

    values = {display_width(line) - display_width(line.split()[-1]) for line in text.splitlines()
              if len(line.split()) <= 3}  # a label (one or two words) and one value
    assert len(values) == 1, text  # every value starts in the same column
    monkeypatch.setenv("MPARLIB_LANG", "en")
    assert "CPU threads" in mparlib.report()


def test_measure_each_interleaves_rounds_until_both_minimums_are_reached():
    from mparlib.timing import measure_each

    clock, order = FakeClock(), []

    def timed(name, seconds):
        def fn():
            order.append(name)
            clock.now += seconds
        return fn

    # durations that binary floating point holds exactly, so that the fake clock adds up without rounding
    got = measure_each({"fast": timed("fast", 2**-10), "slow": timed("slow", 0.25)}, warmup=1, min_seconds=0.05,
                       min_repeats=5, clock=clock, load=lambda: 0.0, cores=1)
    assert order[:4] == ["fast", "slow", "fast", "slow"]  # warm-up round, then the timed rounds, in turn
    assert len(got["fast"].times) == len(got["slow"].times) == 5 and len(order) == 2 * 6  # the count decides
    assert got["fast"].median == 2**-10 and got["slow"].median == 0.25
    clock, order = FakeClock(), []
    # 3 x 2^-10 s a round: 50 ms in all need 18 rounds (17 give 49.8 ms)
    got = measure_each({"fast": timed("fast", 2**-10), "double": timed("double", 2**-9)}, warmup=0,
                       min_seconds=0.05, min_repeats=5, clock=clock, load=lambda: 0.0, cores=1)
    assert len(got["fast"].times) == len(got["double"].times) == 18 and len(order) == 2 * 18
    with pytest.raises(ConfigError, match="measure_each needs a dict"):
        measure_each({})
    with pytest.raises(ConfigError, match="measure_each needs a dict"):
        measure_each([lambda: None])


@pytest.mark.slow
def test_slowest_rank_is_the_elementwise_maximum_over_real_ranks():
    from mparlib.launch import launch
    from mparlib.timing import slowest_rank
    from timing_workers import slowest_of

    rows = [[0.5, 3.0, -1.0], [2.0, 1.0, -2.0], [0.25, 0.0, 7.0]]
    got = launch(slowest_of, 3, args=(rows,), echo=False, timeout=60)
    expected = [max(column) for column in zip(*rows)]
    assert got == [expected] * 3
    with pytest.raises(ConfigError, match="slowest_rank needs a process group"):
        slowest_rank([1.0])


@pytest.mark.slow
def test_measure_with_slowest_rank_gives_every_rank_the_slowest_time_of_each_call():
    from mparlib.launch import launch
    from timing_workers import timed_sleeps

    got = launch(timed_sleeps, 2, args=([0.001, 0.003], 0.02), echo=False, timeout=60)
    (times0, local0), (times1, local1) = got
    assert times0 == times1  # the same list on both ranks
    assert len(local0) == len(local1) == len(times0) >= 3  # both stopped after the same call
    assert times0 == pytest.approx([max(a, b) for a, b in zip(local0, local1)], rel=1e-12)
    assert sum(local0) >= 0.02 and sum(local1) >= 0.02  # each rank had its own minimum duration
    assert min(times0) >= 0.003  # rank 1 slept 3 ms in every call


def test_the_table_printer_lines_up_mixed_widths_in_both_languages(monkeypatch):
    from mparlib.lang import display_width, join, table
    rows = [[("interleaved 1F1B", "インターリーブ 1F1B"), 16, "0.63 ms"], [("ZBV", "ZBV"), 1234, "12.50 ms"]]
    head = [("schedule", "スケジュール"), ("passes", "パス"), ("gap", "隙間")]
    for lang, first in (("en", "interleaved 1F1B"), ("ja", "インターリーブ 1F1B")):
        monkeypatch.setenv("MPARLIB_LANG", lang)
        lines = table(rows, head).splitlines()
        assert lines[1].startswith(first + "  ") and "1,234" in lines[2]  # (en, ja) labels; ints with separators
        # the labels differ in width, yet the numbers (right-aligned) end at one display column, and so do the lines
        assert display_width(lines[1].split("  ")[0]) != display_width(lines[2].split("  ")[0])
        ends = {display_width(line[:line.index(cell) + len(cell)]) for line, cell in zip(lines[1:], ["16", "1,234"])}
        assert len(ends) == 1 and len({display_width(line) for line in lines[1:]}) == 1
        assert display_width(lines[0][:lines[0].index(head[1][lang == "ja"])]) < min(ends)  # a header over it
        assert all(line == line.rstrip() for line in lines)
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert join(["GPipe 8", "1F1B 2"]) == "GPipe 8、1F1B 2" and join([("a", "あ"), 3]) == "あ、3"
    monkeypatch.setenv("MPARLIB_LANG", "en")
    assert join(["GPipe 8", "1F1B 2"]) == "GPipe 8, 1F1B 2"
    assert table([["a", "b"]], align="<>") == "a  b" and table([]) == ""
    assert table([["x", "1"], ["long label", "22"]], indent=2).splitlines() == ["  x            1", "  long label  22"]


def test_the_table_printer_refuses_a_bad_alignment():
    from mparlib.errors import ConfigError
    from mparlib.lang import table
    with pytest.raises(ConfigError, match="one '<' or '>' for each of the 2 columns"):
        table([["a", "b"]], align="<")
    with pytest.raises(ConfigError, match="one '<' or '>'"):
        table([["a", "b"]], align="<^")
