"""mparlib.train: the training loop against a plain SGD loop, device checks, evaluation, interruption, the CLI.

Small CNNs on synthetic images keep these tests fast; ResNet-18 itself runs only in the slow CLI test.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from mparlib import models
from mparlib import train as T


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
    with pytest.raises(ValueError, match="lazy"):
        T.evaluate_accuracy(tiny_cnn(lazy=True), synthetic(16, 16, 0), CPU)


def test_check_devices():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert T.check_devices(None) == ([torch.device("cuda", i) for i in range(n)] or CPU)
    assert T.check_devices("cpu") == CPU
    with pytest.raises(RuntimeError, match=f"PyTorch sees {n} GPU"):
        T.check_devices([f"cuda:{n}"])  # one more than exist: an error, not the CPU
    with pytest.raises(RuntimeError, match=f"PyTorch sees {n} GPU"):
        T.check_devices([n])
    with pytest.raises(ValueError, match="empty.*try_all_gpus"):
        T.check_devices([])
    with pytest.raises(ValueError, match="CUDA GPUs only"):
        T.check_devices(["cpu", "cpu"])
    assert T.check_devices(["cpu", "cpu"], simulated=True) == CPU * 2
    with pytest.raises(ValueError, match="Not a device"):
        T.check_devices(["gpu0"])


def test_device_errors_speak_japanese(monkeypatch):
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(ValueError, match="デバイスのリストが空です"):
        T.check_devices([])


def test_train_checks_devices_before_touching_the_model():
    net = tiny_cnn()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(RuntimeError, match="PyTorch sees"):
        T.train(net, [torch.device("cuda", n)], batch_size=16, lr=0.1, num_epochs=1,
                data=(synthetic(16, 16, 0), synthetic(16, 16, 0)), animator=False)
    assert next(net.parameters()).device.type == "cpu"


@pytest.mark.parametrize("kwargs, match", [(dict(num_epochs=0), "num_epochs"), (dict(lr=-1), "lr"),
                                           (dict(data="fashion"), "data must be")])
def test_train_rejects_bad_arguments(kwargs, match):
    args = dict(batch_size=16, lr=0.1, num_epochs=1, data=(synthetic(16, 16, 0), synthetic(16, 16, 0)),
                animator=False)
    with pytest.raises(ValueError, match=match):
        T.train(tiny_cnn(), CPU, **{**args, **kwargs})


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


def test_cli_help(tmp_path):
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0
    for option in ("--gpus", "--batch-size", "--lr", "--epochs", "--plot"):
        assert option in r.stdout


def test_cli_never_overwrites_and_checks_gpus(tmp_path):
    plot = tmp_path / "mine.png"
    plot.write_bytes(b"user data")
    r = run_cli("--plot", str(plot), cwd=tmp_path)
    assert r.returncode == 2 and "--overwrite" in r.stderr
    assert plot.read_bytes() == b"user data"
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    r = run_cli("--gpus", str(n + 1), "--plot", str(tmp_path / "new.png"), cwd=tmp_path)
    assert r.returncode == 2 and f"PyTorch sees {n}" in r.stderr
    assert not (tmp_path / "new.png").exists()


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
