"""mparlib.loop and mparlib.train: the training loop against a plain SGD loop, device checks, evaluation,
interruption, and the command line with its sizes.

Small CNNs on synthetic images keep these tests fast; ResNet-18 itself runs only in the slow CLI test.
"""
import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from mparlib import loop as T
from mparlib import models, sources
from mparlib import train as C
from mparlib.errors import ConfigError, DeviceError, TrainingDiverged


def tiny_cnn(lazy=False):
    """A small CNN with batch norm: (N, 1, 8, 8) -> (N, 3)."""
    if lazy:
        return nn.Sequential(nn.LazyConv2d(4, 3, padding=1), nn.LazyBatchNorm2d(), nn.ReLU(),
                             nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.LazyLinear(3))
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16, 3))


def synthetic(n, batch_size, seed):
    """Three easy classes of 8x8 images: a bright top half, bottom half or left half, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    X = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    X[y == 0, :, :4, :] += 1.0
    X[y == 1, :, 4:, :] += 1.0
    X[y == 2, :, :, :4] += 1.0
    return [(X[i:i + batch_size], y[i:i + batch_size]) for i in range(0, n, batch_size)]


CPU = [torch.device("cpu")]


def test_train_matches_a_plain_sgd_loop():
    """Same start, same batches: the parameters after train() equal those of the textbook loop."""
    torch.manual_seed(0)
    net = tiny_cnn()
    models.init_weights(net)
    ref = tiny_cnn()
    ref.load_state_dict(net.state_dict())
    train_iter, test_iter = synthetic(96, 16, 1), synthetic(48, 16, 2)
    hist = T.train(net, CPU, batch_size=16, lr=0.1, num_epochs=2, data=(train_iter, test_iter),
                   animator=False, init=False, verbose=False)
    opt, loss = torch.optim.SGD(ref.parameters(), lr=0.1), nn.CrossEntropyLoss()
    for _ in range(2):
        ref.train()
        for X, y in train_iter:
            opt.zero_grad()
            loss(ref(X), y).backward()
            opt.step()
    for (name, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    ref.eval()
    with torch.no_grad():
        acc = sum(int((ref(X).argmax(1) == y).sum()) for X, y in test_iter) / 48
    assert hist.test_acc[-1] == acc


def test_train_learns_and_reports(capsys):
    torch.manual_seed(0)
    hist = T.train(tiny_cnn(), CPU, batch_size=16, lr=0.2, num_epochs=3,
                   data=(synthetic(192, 16, 1), synthetic(96, 32, 2)), animator=False)
    assert hist.epochs == 3 and not hist.interrupted
    for key in ("train_loss", "train_acc", "test_acc", "seconds", "images_per_s"):
        assert len(getattr(hist, key)) == 3, key
    assert hist.train_loss[-1] < hist.train_loss[0]
    assert hist.test_acc[-1] >= 0.9  # chance is 1/3
    assert all(s > 0 for s in hist.seconds)
    assert hist.images_per_s[0] == pytest.approx(192 / hist.seconds[0])
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == hist.summary()
    assert re.fullmatch(r"test acc: \d\.\d\d, \d+\.\d sec/epoch on \[device\(type='cpu'\)\]", out[-1])
    assert json.loads(json.dumps(hist.to_dict()))["devices"] == ["cpu"]


def test_train_initialises_lazy_layers():
    torch.manual_seed(0)
    net = tiny_cnn(lazy=True)
    hist = T.train(net, CPU, batch_size=16, lr=0.2, num_epochs=1,
                   data=(synthetic(64, 16, 1), synthetic(32, 16, 2)), animator=False, verbose=False)
    assert models.lazy_modules(net) == [] and hist.epochs == 1


def test_train_reinitialises_by_default():
    """Two runs from the same seed give the same result although the second starts from a trained model."""
    data = (synthetic(64, 16, 1), synthetic(32, 16, 2))
    net = tiny_cnn()
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(T.train(net, CPU, batch_size=16, lr=0.2, num_epochs=1, data=data, animator=False,
                            verbose=False).train_loss)
    assert runs[0] == runs[1]


class StopAfter:
    """Yields batches and presses Ctrl-C (raises KeyboardInterrupt) at batch ``stop`` of epoch ``epoch``."""

    def __init__(self, batches, epoch, stop):
        self.batches, self.epoch, self.stop, self.calls = batches, epoch, stop, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.calls += 1
        for i, b in enumerate(self.batches):
            if self.calls == self.epoch and i == self.stop:
                raise KeyboardInterrupt
            yield b


def test_interrupt_returns_history_so_far(capsys):
    train_iter = StopAfter(synthetic(64, 16, 1), epoch=3, stop=2)
    hist = T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=5, data=(train_iter, synthetic(32, 16, 2)),
                   animator=False)
    assert hist.interrupted and hist.epochs == 2 and len(hist.seconds) == 2
    out = capsys.readouterr().out
    assert "Interrupted in epoch 3 after 2 batch(es)" in out
    assert hist.summary() in out


def test_interrupt_in_the_first_epoch(capsys):
    hist = T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=2,
                   data=(StopAfter(synthetic(64, 16, 1), epoch=1, stop=0), synthetic(32, 16, 2)), animator=False)
    assert hist.interrupted and hist.epochs == 0
    assert "test acc" not in capsys.readouterr().out


def test_live_plot_written_headless(tmp_path):
    from mparlib.plot import Animator

    path = tmp_path / "curves.png"
    anim = Animator(legend=["a", "b", "c"], path=path, display=False)
    T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=2, data=(synthetic(80, 16, 1), synthetic(32, 16, 2)),
            animator=anim, verbose=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(anim.X[2]) == 2 and len(anim.X[0]) == 2 + 2 * 4  # test acc per epoch; train curves 5 points/epoch


def test_evaluate_accuracy_against_direct_count():
    torch.manual_seed(0)
    net = tiny_cnn()
    data = synthetic(50, 16, 3)  # last batch of 2
    net.eval()
    with torch.no_grad():
        want = sum(int((net(X).argmax(1) == y).sum()) for X, y in data) / 50
    net.train()
    assert T.evaluate_accuracy(net, data) == want
    assert T.evaluate_accuracy(net, data, ["cpu"] * 3) == want  # batches split over three simulated devices
    assert T.evaluate_accuracy(nn.DataParallel(net), data, CPU) == want
    assert net.training  # mode restored


def test_evaluate_accuracy_refuses_lazy_model():
    with pytest.raises(ConfigError, match="lazy"):
        T.evaluate_accuracy(tiny_cnn(lazy=True), synthetic(16, 16, 0), CPU)


NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def run_on(devices, what="train"):
    """The devices a short train() or evaluate_accuracy() call ran on, after checking them."""
    net, batches = tiny_cnn(), synthetic(16, 16, 0)
    if what == "evaluate":
        return T.evaluate_accuracy(net, batches, devices)
    return T.train(net, devices, batch_size=16, lr=0.1, num_epochs=1, data=(batches, batches), animator=False,
                   verbose=False).devices


def test_device_lists():
    assert run_on(None) == ([torch.device("cuda", i) for i in range(NUM_GPUS)] or CPU)
    assert run_on([-1]) == CPU  # torch.nn.parallel's number of the CPU
    assert run_on(["cpu", "cpu"]) == CPU * 2  # two simulated devices
    for what in ("train", "evaluate"):
        with pytest.raises(DeviceError, match=re.escape("write ['cpu']")):
            run_on("cpu", what)  # one device alone is not a list of one
        with pytest.raises(DeviceError, match=f"cuda:{NUM_GPUS} does not exist"):
            run_on([f"cuda:{NUM_GPUS}"], what)  # one more than exist: an error, not the CPU
        with pytest.raises(DeviceError, match=f"cuda:{NUM_GPUS} does not exist"):
            run_on([NUM_GPUS], what)
        with pytest.raises(DeviceError, match="empty.*try_all_gpus"):
            run_on([], what)
        with pytest.raises(DeviceError, match="CUDA GPUs only"):
            run_on(["cpu", "cpu:0"], what)  # two CPU devices that are not one device listed twice
        with pytest.raises(DeviceError, match="is not a device"):
            run_on(["gpu0"], what)


def test_the_course_device_check_runs_once_per_call(monkeypatch):
    """train's rules sit on top of mparlib.devices.check_devices: it sees every list once per call (not per
    epoch), and its verdict stands."""
    seen = []
    real = T.check_devices
    monkeypatch.setattr(T, "check_devices", lambda d, what="devices": seen.append(list(d)) or real(d, what))
    batches = synthetic(16, 16, 0)
    T.train(tiny_cnn(), CPU * 2, batch_size=16, lr=0.1, num_epochs=3, data=(batches, batches), animator=False,
            verbose=False)
    T.evaluate_accuracy(tiny_cnn(), batches, ["cpu"])
    with pytest.raises(DeviceError, match="mixes kinds"):
        run_on(["cpu", "meta"])
    assert seen == [CPU * 2, ["cpu"], ["cpu", "meta"]]


def test_device_errors_speak_japanese(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(DeviceError, match="が空です"):
        run_on([])
    with pytest.raises(DeviceError, match="CUDA の GPU だけ"):
        run_on(["cpu", "cpu:0"])


def test_train_checks_devices_before_touching_the_model():
    net = tiny_cnn()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match="does not exist"):
        T.train(net, [torch.device("cuda", n)], batch_size=16, lr=0.1, num_epochs=1,
                data=(synthetic(16, 16, 0), synthetic(16, 16, 0)), animator=False)
    assert next(net.parameters()).device.type == "cpu"


TOY = (synthetic(16, 16, 0), synthetic(16, 16, 0))


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_epochs=0), "num_epochs=0"), (dict(num_epochs=1.5), "num_epochs=1.5"),
    (dict(num_epochs=True), "num_epochs=True"), (dict(num_epochs="3"), "num_epochs='3'"),
    (dict(lr=-1), "lr=-1"), (dict(lr=0), "lr=0"), (dict(lr=float("nan")), "lr=nan"),
    (dict(lr=float("inf")), "lr=inf"), (dict(lr="0.1"), "lr='0.1'"), (dict(batch_size=0), "batch_size=0"),
    (dict(batch_size=-16), "batch_size=-16"), (dict(data="fashion"), "data must be"),
])
def test_train_rejects_bad_hyperparameters(kwargs, match):
    """Each bad value is refused before any work, naming the value; non-finite ones included (nan <= 0 is False)."""
    args = dict(batch_size=16, lr=0.1, num_epochs=1, data=TOY, animator=False)
    net = tiny_cnn()
    before = copy.deepcopy(net.state_dict())
    with pytest.raises(ConfigError, match=re.escape(match)):
        T.train(net, CPU, **{**args, **kwargs})
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), before.values()))  # not touched


class OneBatchOfX:
    """An iterable whose batches are images without labels."""

    def __iter__(self):
        yield torch.zeros(4, 1, 8, 8)


@pytest.mark.parametrize("net, devices, data, error, match", [
    (tiny_cnn(), 3.5, TOY, DeviceError, "not a list of devices"),
    (tiny_cnn(), [0.5], TOY, DeviceError, "0.5 is not a device"),
    (tiny_cnn(), ["cuda:0", "cpu"], TOY, DeviceError, "mixes kinds"),
    (tiny_cnn(), CPU, (TOY[0],), ConfigError, "data must be"),
    (tiny_cnn(), CPU, (torch.zeros(16, 1, 8, 8), torch.zeros(16)), ConfigError, "train_iter is a tensor of shape"),
    (tiny_cnn(), CPU, (iter(TOY[0]), TOY[1]), ConfigError, "one-pass iterator"),
    (tiny_cnn(), CPU, (TOY[0], (b for b in TOY[1])), ConfigError, "test_iter is a one-pass iterator"),
    (tiny_cnn(), CPU, (3, TOY[1]), ConfigError, "train_iter is int"),
    (tiny_cnn(), CPU, ([], TOY[1]), ConfigError, "train_iter yielded no batch"),
    (tiny_cnn(), CPU, (TOY[0], []), ConfigError, "test_iter yielded no batch"),
    (tiny_cnn(lazy=True), CPU, (TOY[0], []), ConfigError, "test_iter yielded no batch"),
    (tiny_cnn(), CPU, (OneBatchOfX(), TOY[1]), ConfigError, "yielded a tensor of shape \\(4, 1, 8, 8\\)"),
    (tiny_cnn(), CPU, ([(1, 2, 3)], TOY[1]), ConfigError, "yielded tuple; each batch must be a pair"),
    (lambda X: X, CPU, TOY, ConfigError, "pass a torch.nn.Module"),
    (nn.ReLU(), CPU, TOY, ConfigError, "no parameters"),
    (nn.Linear(64, 3, device="meta"), CPU, TOY, ConfigError, "meta"),
])
def test_train_explains_bad_inputs(net, devices, data, error, match):
    with pytest.raises(error, match=match):
        T.train(net, devices, batch_size=16, lr=0.1, num_epochs=2, data=data, animator=False, verbose=False)


class NaNAt:
    """Batches of ``batches``, with NaN in the images of step ``step`` (counted from 1) of epoch ``epoch``."""

    def __init__(self, batches, epoch, step):
        self.batches, self.epoch, self.step, self.passes = batches, epoch, step, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.passes += 1
        for i, (X, y) in enumerate(self.batches, 1):
            yield (X * float("nan") if (self.passes, i) == (self.epoch, self.step) else X), y


class NaNModel(nn.Module):
    """tiny_cnn whose output turns NaN from its ``bad``-th call in training mode on."""

    def __init__(self, bad):
        super().__init__()
        self.net, self.calls, self.bad = tiny_cnn(), 0, bad

    def forward(self, X):
        self.calls += self.training
        out = self.net(X)
        return out * float("nan") if self.training and self.calls >= self.bad else out


@pytest.mark.parametrize("source", ["input", "model"])
def test_training_stops_at_the_first_non_finite_loss(source):
    """A NaN loss in step 5 of epoch 2 (6 steps per epoch; the loop reads its sums after steps 1, 2, 3, 4 and 6)
    stops training there, names that step (not the step where it was noticed), and keeps epoch 1's history."""
    torch.manual_seed(0)
    batches = synthetic(96, 16, 1)
    train_iter = NaNAt(batches, 2, 5) if source == "input" else NaNAt(batches, 0, 0)
    net = tiny_cnn() if source == "input" else NaNModel(bad=6 + 5)
    with pytest.raises(TrainingDiverged, match=r"became nan in epoch 2, step 5;") as e:
        T.train(net, CPU, batch_size=16, lr=0.1, num_epochs=4, data=(train_iter, synthetic(32, 16, 2)),
                animator=False, verbose=False)
    assert isinstance(e.value, ArithmeticError)
    assert train_iter.passes == 2  # epochs 3 and 4 never started
    assert e.value.history.epochs == 1 and math.isfinite(e.value.history.train_loss[0])


def test_divergence_message_speaks_japanese(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(TrainingDiverged, match="1エポック目のステップ 2 で訓練損失が nan"):
        T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=1,
                data=(NaNAt(synthetic(64, 16, 1), 1, 2), synthetic(32, 16, 2)), animator=False, verbose=False)


@pytest.mark.gpu
def test_train_on_all_gpus_keeps_the_model_on_gpu0():
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    torch.manual_seed(0)
    net = tiny_cnn()
    hist = T.train(net, devices, batch_size=32, lr=0.2, num_epochs=3,
                   data=(synthetic(192, 32, 1), synthetic(96, 32, 2)), animator=False, verbose=False)
    assert hist.test_acc[-1] >= 0.9
    assert all(p.device == devices[0] for p in net.parameters())
    net.eval()
    with torch.no_grad():  # evaluation split over all GPUs counts what one GPU counts
        assert T.evaluate_accuracy(net, synthetic(96, 32, 2), devices) == T.evaluate_accuracy(
            net, synthetic(96, 32, 2), devices[:1])


def run_cli(*args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPARLIB_PROFILE": "smoke", "MPARLIB_QUIET": "1"}
    return subprocess.run([sys.executable, "-m", "mparlib.train", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_cli_help(tmp_path):
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    for option in ("--gpus", "--batch-size", "--lr", "--epochs", "--plot"):
        assert option in r.stdout


@pytest.mark.slow
def test_cli_lr_nan_exits_2_with_the_reason(tmp_path):
    """`python -m mparlib.train --lr nan` used to train and print `train loss nan` with exit code 0."""
    r = run_cli("--lr", "nan", cwd=tmp_path)
    assert r.returncode == 2 and "--lr" in r.stderr and "'nan' is not a positive, finite number" in r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, says", [
    (["--lr", "inf"], "'inf' is not a positive, finite number"), (["--lr", "-0.1"], "is not a positive"),
    (["--batch-size", "0"], "'0' is not a positive integer"), (["--epochs", "0"], "'0' is not a positive integer"),
    (["--subset", "0"], "'0' is not a positive integer"), (["--subset", "1", "2", "3"], "--subset takes N"),
    (["--gpus", str(NUM_GPUS + 1)], f"PyTorch sees {NUM_GPUS} GPU(s)"), (["--gpus", "0"], "is not a positive"),
    (["--gpus", "1", "--cpu"], "either --gpus N or --cpu"), (["--fast", "--gpus", "2"], "--fast trains on one device"),
    (["--plot", "a.png", "--json", "./a.png"], "the same file"), (["--plot", "."], "is a folder"),
])
def test_cli_refuses_bad_options_before_any_work(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        C.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written, no run folder


def test_the_chapter_05_runs_are_the_command_line_defaults(tmp_path, monkeypatch):
    """One definition of chapter 05's sizes: the notebook's runs, and what the command trains without options."""
    assert C.experiment(1, "smoke") == dict(width=8, batch_size=16, lr=0.025, num_epochs=3, subset=(4000, 1000))
    assert C.experiment(1, "full") == dict(width=64, batch_size=256, lr=0.1, num_epochs=10, subset=None)
    assert C.experiment(2, "full") == dict(width=64, batch_size=512, lr=0.2, num_epochs=10, subset=None)  # d2l's
    with pytest.raises(ConfigError, match="k=0"):
        C.experiment(0)
    monkeypatch.chdir(tmp_path)
    for profile in ("smoke", "full"):
        monkeypatch.setenv("MPARLIB_PROFILE", profile)
        seen = {}

        def train(net, devices, **kwargs):
            seen.update(kwargs, width=net[0].out_channels, subset=kwargs["data"]["subset"])
            return T.History(devices=devices)

        monkeypatch.setattr(C, "train", train)
        assert C.main(["--cpu", "--plot", f"{profile}.png"]) == 0
        want = C.experiment(1)
        assert {k: seen[k] for k in want} == want
        assert C.main(["--cpu", "--plot", f"{profile}-2.png", "--width", "4", "--lr", "0.5"]) == 0
        assert (seen["width"], seen["lr"], seen["batch_size"]) == (4, 0.5, want["batch_size"])


def test_cli_never_overwrites_unless_told(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for option in ("--plot", "--json"):
        mine = tmp_path / f"mine{option}"
        mine.write_bytes(b"user data")
        with pytest.raises(SystemExit) as e:
            C.main([option, str(mine)])
        assert e.value.code == 2 and "--overwrite" in capsys.readouterr().err
        assert mine.read_bytes() == b"user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine--json", "mine--plot"]


def test_run_folders_are_new_every_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(C.time, "strftime", lambda fmt: "20250101-120000")  # two runs within the same second
    old = tmp_path / "runs" / "train-20250101-120000"
    old.mkdir(parents=True)
    (old / "history.json").write_text("an earlier run")
    monkeypatch.setattr(C, "train", lambda net, devices, **kwargs: T.History(devices=devices))
    assert C.main(["--cpu"]) == C.main(["--cpu"]) == 0
    new = sorted(p.name for p in (tmp_path / "runs").iterdir() if p != old)
    assert new == ["train-20250101-120000-2", "train-20250101-120000-3"]
    assert (old / "history.json").read_text() == "an earlier run"


def fake_train(raises):
    def train(net, devices, **kwargs):
        kwargs["animator"].add(1, (1.0, 0.5, 0.5))  # the plot of a first epoch, as the real loop draws it
        history = T.History(devices=devices, train_loss=[1.0], train_acc=[0.5], test_acc=[0.5], seconds=[1.0],
                            images_per_s=[64.0])
        error = raises()
        error.history = history
        raise error
    return train


def test_cli_reports_course_errors_and_keeps_what_was_done(tmp_path, monkeypatch, capsys):
    """A course error prints `error: ...` and exits 2; a diverged run keeps its plot and its finished epochs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(C, "train", fake_train(lambda: TrainingDiverged("the loss became nan in epoch 2, step 5")))
    assert C.main(["--cpu"]) == 2
    assert "error: the loss became nan in epoch 2, step 5" in capsys.readouterr().err
    (run,) = (tmp_path / "runs").iterdir()
    assert json.loads((run / C.HISTORY_NAME).read_text())["test_acc"] == [0.5]
    assert (run / C.PLOT_NAME).read_bytes()[:4] == b"\x89PNG"


def test_cli_interrupted_run_keeps_its_files_and_exits_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C during training: train() returns the finished epochs; the command writes them and exits 130."""
    monkeypatch.chdir(tmp_path)

    def interrupted(net, devices, **kwargs):
        kwargs["animator"].add(1, (1.0, 0.5, 0.5))
        return T.History(devices=devices, train_loss=[1.0], train_acc=[0.5], test_acc=[0.5], seconds=[1.0],
                         images_per_s=[64.0], interrupted=True)

    monkeypatch.setattr(C, "train", interrupted)
    assert C.main(["--cpu", "--json", "h.json"]) == 130
    assert json.loads((tmp_path / "h.json").read_text())["interrupted"] is True
    (run,) = (tmp_path / "runs").iterdir()
    assert [p.name for p in run.iterdir()] == [C.PLOT_NAME]  # --json said where the history goes
    assert "history: h.json" in capsys.readouterr().out


def test_cli_leaves_no_empty_run_folder_and_shows_bugs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    def fails(error):
        def train(*args, **kwargs):
            raise error
        return train

    monkeypatch.setattr(C, "train", fails(ConfigError("bad setting")))
    assert C.main(["--cpu"]) == 2 and "error: bad setting" in capsys.readouterr().err
    monkeypatch.setattr(C, "train", fails(KeyboardInterrupt()))  # Ctrl-C while the data loads
    assert C.main(["--cpu"]) == 130 and "Interrupted before the first epoch" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # the empty run folders (and runs/) are gone
    monkeypatch.setattr(C, "train", fails(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # not a course error: its traceback shows
        C.main(["--cpu"])


@pytest.mark.skipif(not all((sources.SYSTEM_DIR / (f + ".gz")).is_file() or (sources.SYSTEM_DIR / f).is_file()
                            for f in sources.FILES["train"] + sources.FILES["test"]),
                    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")
def test_cli_writes_into_a_new_run_folder_by_default(tmp_path, monkeypatch, capsys):
    """Without --plot nothing lands in the current folder except runs/train-<time>/ with the plot and history."""
    monkeypatch.chdir(tmp_path)
    argv = ["--cpu", "--subset", "64", "32", "--batch-size", "32", "--epochs", "1", "--data", str(sources.SYSTEM_DIR)]
    assert C.main(argv) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["runs"]
    (run,) = (tmp_path / "runs").iterdir()
    assert re.fullmatch(r"train-\d{8}-\d{6}", run.name)
    assert sorted(p.name for p in run.iterdir()) == sorted([C.PLOT_NAME, C.HISTORY_NAME])
    assert (run / C.PLOT_NAME).read_bytes()[:4] == b"\x89PNG"
    hist = json.loads((run / C.HISTORY_NAME).read_text())
    assert hist["devices"] == ["cpu"] and len(hist["test_acc"]) == 1 and hist["batch_size"] == 32
    out = capsys.readouterr().out
    assert f"run folder: {Path('runs') / run.name}" in out and f"history: {Path('runs') / run.name}" in out


@pytest.mark.slow
def test_cli_runs_the_experiment(tmp_path):
    r = run_cli("--cpu", "--subset", "64", "32", "--batch-size", "32", "--lr", "0.1", "--epochs", "1",
                "--plot", "run.png", "--json", "run.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    hist = json.loads((tmp_path / "run.json").read_text())
    assert hist["devices"] == ["cpu"] and len(hist["test_acc"]) == 1 and hist["batch_size"] == 32
    assert "test acc:" in r.stdout


def test_progress_bar_when_asked(capsys):
    T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=1, data=(synthetic(64, 16, 1), synthetic(32, 16, 2)),
            animator=False, verbose=False, progress=True)
    assert "epoch 1/1" in capsys.readouterr().err
    T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=1, data=(synthetic(64, 16, 1), synthetic(32, 16, 2)),
            animator=False, verbose=False)  # default under pytest: quiet
    assert capsys.readouterr().err == ""


class CountsIter:
    """Batches of ``synthetic``; counts how often it is iterated, reshuffling its batches each time (as a
    DataLoader with a shuffling sampler does)."""

    def __init__(self, batches):
        self.batches, self.iters = batches, 0

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        self.iters += 1
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(self.iters))
        return iter([self.batches[i] for i in order])


@pytest.mark.parametrize("widgets", [True, False])
def test_a_progress_bar_iterates_the_data_once_and_changes_nothing(monkeypatch, widgets, capsys):
    # tqdm.auto's bar (Jupyter with ipywidgets) calls iter() on what it wraps when it is made: a DataLoader would
    # start its workers twice and train on the next epoch's shuffle. The course's bar only counts.
    import mparlib.progress as progress

    monkeypatch.setattr(progress, "in_kernel", lambda: widgets)
    histories, seen = [], []
    for shown in (True, False):
        torch.manual_seed(0)
        train_iter = CountsIter(synthetic(64, 16, 1))
        histories.append(T.train(tiny_cnn(), CPU, batch_size=16, lr=0.1, num_epochs=2, verbose=False, animator=False,
                                 data=(train_iter, synthetic(32, 16, 2)), progress=shown))
        seen.append(train_iter.iters)
    assert seen == [2, 2]  # once per epoch, with the bar and without
    assert histories[0].train_loss == histories[1].train_loss and histories[0].test_acc == histories[1].test_acc


# --- simulated devices: the CPU listed several times ---------------------------------------------------------

class Recorder(nn.Module):
    """A float64 CNN without batch norm that records the batch size and CPU thread count of each forward call."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(),
                                 nn.Linear(16, 3)).double()
        self.seen = []

    def forward(self, X):
        self.seen.append((len(X), torch.get_num_threads()))
        return self.net(X)


def float64_batches(n, batch_size, seed):
    return [(X.double(), y) for X, y in synthetic(n, batch_size, seed)]


def test_one_step_over_two_simulated_devices_equals_one_step_on_one_device():
    """train(net, ["cpu", "cpu"]) splits each batch with mparlib.parallel.data_parallel; without batch norm the
    step is the one-device step on the whole batch (the mean of the two halves' gradients), to float64 rounding."""
    torch.manual_seed(0)
    one, two = Recorder(), Recorder()
    two.load_state_dict(one.state_dict())
    batch = float64_batches(10, 10, 1)
    for net, devices in ((one, ["cpu"]), (two, ["cpu", "cpu"])):
        hist = T.train(net, devices, lr=0.5, num_epochs=1, data=(batch, batch), animator=False, init=False,
                       verbose=False)
    moved = max((a - b).abs().max().item() for a, b in zip(one.state_dict().values(), Recorder().state_dict().values()))
    for (name, a), b in zip(one.state_dict().items(), two.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert moved > 1e-3  # the step really moved the weights
    assert [n for n, _ in one.seen[:1]] == [10] and [n for n, _ in two.seen[:2]] == [5, 5]  # split in two halves
    assert hist.devices == [torch.device("cpu")] * 2


def test_several_epochs_over_simulated_devices_follow_the_one_device_run():
    torch.manual_seed(0)
    one, three = Recorder(), Recorder()
    three.load_state_dict(one.state_dict())
    train_iter, test_iter = float64_batches(60, 12, 1), float64_batches(30, 15, 2)
    h1 = T.train(one, ["cpu"], lr=0.3, num_epochs=2, data=(train_iter, test_iter), animator=False, init=False,
                 verbose=False)
    h3 = T.train(three, ["cpu"] * 3, lr=0.3, num_epochs=2, data=(train_iter, test_iter), animator=False, init=False,
                 verbose=False)
    for a, b in zip(one.state_dict().values(), three.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert h1.test_acc == h3.test_acc
    for x, y in zip(h1.train_loss, h3.train_loss):
        assert math.isclose(x, y, rel_tol=1e-12)


def test_simulated_devices_normalise_each_part_with_its_own_statistics():
    """With batch norm, as with nn.DataParallel: each replica normalises its half with that half's statistics,
    and only replica 0's half updates the running statistics. The reference computes exactly that by hand."""
    torch.manual_seed(0)
    net = tiny_cnn().double()
    models.init_weights(net)
    ref = copy.deepcopy(net)
    (X, y), = float64_batches(8, 8, 3)
    T.train(net, ["cpu", "cpu"], lr=0.5, num_epochs=1, data=([(X, y)], [(X, y)]), animator=False, init=False,
            verbose=False)
    ref.train()
    params = dict(ref.named_parameters())
    out0 = ref(X[:4])  # updates ref's running statistics, as replica 0 shares the model's buffers
    throwaway = {k: v.clone() for k, v in ref.named_buffers()}  # replica 1's copies, dropped after the step
    out1 = torch.func.functional_call(ref, {**params, **throwaway}, (X[4:],))
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    nn.functional.cross_entropy(torch.cat([out0, out1]), y).backward()
    opt.step()
    for (name, a), b in zip(net.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    whole = copy.deepcopy(net)  # and the split matters: one device normalises all 8 images together
    assert not torch.allclose(whole.train()(X)[:4], whole.train()(X[:4]))


def test_each_simulated_device_gets_its_share_of_the_cpu_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        net = Recorder()
        T.train(net, ["cpu", "cpu"], lr=0.1, num_epochs=1, data=(float64_batches(8, 8, 1), float64_batches(8, 8, 2)),
                animator=False, init=False, verbose=False)
        assert [t for _, t in net.seen[:2]] == [1, 1]  # two replicas on two threads, not four
        assert torch.get_num_threads() == 2  # restored after each forward pass
    finally:
        torch.set_num_threads(before)


def test_wrap_model_picks_what_the_devices_call_for():
    from mparlib.step import SimulatedDataParallel, wrap_model

    net = tiny_cnn()
    assert wrap_model(net, CPU) is net
    sim = wrap_model(net, CPU * 2)
    assert isinstance(sim, SimulatedDataParallel) and sim.module is net and sim.devices == CPU * 2
    X = torch.randn(6, 1, 8, 8)
    net.eval()
    with torch.no_grad():
        torch.testing.assert_close(sim(X), net(X))
    if torch.cuda.device_count() >= 2:
        gpus = [torch.device("cuda", i) for i in range(2)]
        assert isinstance(wrap_model(net.to(gpus[0]), gpus), nn.DataParallel)


def test_mixed_simulated_and_real_devices_are_refused():
    with pytest.raises(DeviceError, match="mixes kinds|CUDA GPUs only"):
        T.train(tiny_cnn(), ["cpu", "meta"], batch_size=16, lr=0.1, num_epochs=1, data=TOY, animator=False)
