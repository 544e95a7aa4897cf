"""Train a classifier on one or several devices, d2l style but robust. Explained in 05_multi_gpu_resnet.

:func:`train` moves the model to ``devices[0]``, wraps it in ``nn.DataParallel`` only when there are several
GPUs, initialises its weights (lazy layers included), trains with SGD, plots train loss and accuracies live,
and returns a :class:`History`. Ctrl-C (or the notebook's stop button) ends training early and still returns
the epochs done so far.

The chapter-5 experiment as a script (writes its plot to a PNG)::

    python -m mparlib.train --help
    python -m mparlib.train --gpus 2 --batch-size 512 --lr 0.2 --plot resnet18_2gpus.png

One step is split into small helpers (:func:`make_optimizer`, :func:`autocast_context`, :func:`move_batch`,
:func:`train_step`) so that a variant (another optimiser, mixed precision, data already on the device) replaces a
helper instead of copying the loop. ``train(..., fast=True)`` (or ``fast=FastPath(...)``) plugs in the fast
helpers: data resident on the device, ``channels_last``, bf16 autocast, fused SGD with momentum and a warm-up +
cosine learning-rate schedule, label smoothing, optional ``torch.compile`` and CUDA graphs (07_performance).
"""
import argparse
import contextlib
import functools
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from .devices import num_gpus, profile, require_gpus, try_all_gpus
from .lang import tr
from .models import init_weights, lazy_modules, resnet18
from .parallel import scatter, unwrap
from .timing import Timer


# --- devices -------------------------------------------------------------------------------------------------

def check_devices(devices, *, simulated=False):
    """Return ``devices`` as a list of ``torch.device``, or raise a clear error. Explained in 05_multi_gpu_resnet.

    Accepts one device or a list of devices, ``"cuda:1"`` strings or GPU indices (``[0, 1]``). Every GPU must exist
    (no silent fallback to the CPU, unlike ``d2l.try_gpu``); several devices must all be GPUs, because
    ``nn.DataParallel`` splits a batch over CUDA devices only. ``simulated=True`` also accepts the CPU listed k
    times (``["cpu"] * 2``), which :func:`evaluate_accuracy` can split batches over, as in 03_primitives.
    """
    if devices is None:
        return try_all_gpus()
    if isinstance(devices, (str, int, torch.device)):
        devices = [devices]
    try:
        devices = [torch.device("cuda", d) if isinstance(d, int) else torch.device(d) for d in devices]
    except (TypeError, RuntimeError) as e:
        raise ValueError(tr(f"Not a device list: {devices!r} ({e}). Use e.g. [torch.device('cuda:0')] or "
                            "mparlib.try_all_gpus().",
                            f"デバイスのリストではありません: {devices!r}（{e}）。[torch.device('cuda:0')] や "
                            "mparlib.try_all_gpus() を渡してください。")) from None
    if not devices:
        raise ValueError(tr(
            "The device list is empty (d2l.try_all_gpus() returns [] on a machine without a GPU). "
            "Pass devices=mparlib.try_all_gpus(), which falls back to [cpu].",
            "デバイスのリストが空です（GPU のないマシンでは d2l.try_all_gpus() が [] を返します）。"
            "CPU だけのときは [cpu] を返す mparlib.try_all_gpus() を渡してください。"))
    devices = [torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d for d in devices]
    have = num_gpus()
    missing = [d for d in devices if d.type == "cuda" and d.index >= have]
    if missing:
        raise RuntimeError(tr(
            f"This run asks for {', '.join(map(str, missing))}, but PyTorch sees {have} GPU(s). Ask for at most "
            f"{have} GPU(s) (mparlib.require_gpus(n) checks it), or pass devices=mparlib.try_all_gpus() to use "
            "what exists (the CPU when there is no GPU).",
            f"この実行は {', '.join(map(str, missing))} を指定していますが、PyTorch から見える GPU は {have}枚です。"
            f"GPU は {have}枚以下で指定するか（mparlib.require_gpus(n) で確認できます）、"
            "devices=mparlib.try_all_gpus() で今あるデバイス（GPU がなければ CPU）を使ってください。"))
    if simulated and len(devices) > 1 and all(d.type == "cpu" for d in devices):
        return devices
    if len(devices) > 1 and any(d.type != "cuda" for d in devices):
        raise ValueError(tr(
            f"nn.DataParallel splits a batch over CUDA GPUs only, so {devices} cannot be used together. "
            "Train on one device, e.g. devices=[torch.device('cpu')] (03_primitives simulates several devices on the "
            "CPU with mparlib.parallel.data_parallel).",
            f"nn.DataParallel がミニバッチを分配できるのは CUDA の GPU だけなので、{devices} はまとめて使えません。"
            "devices=[torch.device('cpu')] のように1つのデバイスで訓練してください（CPU 上で複数のデバイスを模擬する方法は "
            "03_primitives の mparlib.parallel.data_parallel で扱います）。"))
    if len(set(devices)) != len(devices):
        raise ValueError(tr(f"A device appears twice in {devices}: list each device once.",
                            f"{devices} に同じデバイスが2回あります。各デバイスは1回だけ指定してください。"))
    return devices


# --- evaluation ----------------------------------------------------------------------------------------------

def evaluate_accuracy(net, data_iter, devices=None):
    """Fraction of correct predictions, each batch split over ``devices``. Explained in 05_multi_gpu_resnet.

    Like d2l's ``evaluate_accuracy_gpus``: every device gets a shard of each batch and a copy of the model (in
    evaluation mode, so batch norm uses its running statistics and the shards do not change the result); the
    correct predictions of the shards are summed. ``devices`` defaults to the device of the model's parameters.
    """
    module = unwrap(net)
    if devices is None:
        devices = [next(module.parameters()).device]
    devices = check_devices(devices, simulated=True)
    lazy = lazy_modules(module)
    if lazy:
        raise ValueError(tr(f"The model still has lazy layers (e.g. {lazy[0]!r}): run one forward pass or "
                            "mparlib.models.init_weights(net, example_batch) first.",
                            f"モデルにまだ遅延層があります（例: {lazy[0]!r}）。先に順伝播を1回実行するか、"
                            "mparlib.models.init_weights(net, example_batch) を呼んでください。"))
    was_training = module.training
    module.eval()
    home = next(module.parameters()).device
    # one copy per device; the model itself serves the device it lives on
    replicas = [module if d == home else _copy_to(module, d) for d in devices]
    correct = [torch.zeros((), dtype=torch.int64, device=d) for d in devices]  # summed on each device, no sync
    count = 0
    try:
        with torch.no_grad():
            for X, y in data_iter:
                X_shards, y_shards = scatter(X, devices), scatter(y, devices)  # torch.chunk sizes
                for i, (replica, Xs, ys) in enumerate(zip(replicas, X_shards, y_shards)):
                    correct[i] += (replica(Xs).argmax(dim=1) == ys).sum()
                count += len(y)
    finally:
        module.train(was_training)
    if count == 0:
        raise ValueError(tr("The test iterator yielded no batch.", "テスト用のイテレータがバッチを1つも返しませんでした。"))
    return sum(int(c) for c in correct) / count


def _copy_to(module, device):
    import copy

    return copy.deepcopy(module).to(device)


# --- one training step, in replaceable pieces ----------------------------------------------------------------

def make_optimizer(net, lr):
    """The optimiser of the chapter: plain minibatch SGD. Explained in 05_multi_gpu_resnet."""
    return torch.optim.SGD(net.parameters(), lr=lr)


def autocast_context(device, dtype=None):
    """The numeric context of the forward pass: fp32 by default, ``torch.autocast`` for ``dtype=torch.bfloat16``."""
    if dtype is None or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)


def move_batch(X, y, device):
    """Move one mini-batch to the device that ``nn.DataParallel`` scatters from (``devices[0]``)."""
    return X.to(device, non_blocking=True), y.to(device, non_blocking=True)


def train_step(net, X, y, loss_fn, optimizer, autocast=contextlib.nullcontext):
    """One SGD step on a batch; returns (loss sum, number correct, batch size) as tensors (no device sync)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast():
        y_hat = net(X)  # (B, num_classes)
        loss = loss_fn(y_hat, y)  # mean over the batch
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        return loss.detach() * len(y), (y_hat.argmax(dim=1) == y).sum(), len(y)


# --- the fast path: the same loop with faster helpers (07_performance) ---------------------------------------

@functools.lru_cache(maxsize=None)
def cpu_has_bf16():
    """True when the CPU has bf16 dot-product instructions (AVX512-BF16 or AMX). Explained in 07_performance.

    There bf16 convolutions and matrix products run about twice as fast as fp32; on other CPUs PyTorch emulates
    bf16 and autocast gains nothing. Read from ``/proc/cpuinfo`` (Linux); False where it cannot be read.
    """
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", text) is not None


def bf16_native(device):
    """Whether ``device`` computes bf16 natively (Ampere or newer GPUs, bf16 CPUs). Explained in 07_performance."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device.type == "cpu" and cpu_has_bf16()


@dataclass(frozen=True)
class FastPath:
    """Settings of :func:`train`'s fast path; each one can be switched off alone. Explained in 07_performance.

    - ``resident``: when :func:`train` loads the data (``data`` is None or a dict), the whole set stays on the device
      as uint8 and each batch is gathered and normalised there (:class:`mparlib.data.ResidentLoader`).
    - ``channels_last``: model and batches in NHWC memory layout, the layout fast convolution kernels use.
    - ``precision``: ``"auto"`` uses bf16 autocast where the device computes bf16 natively (see :func:`bf16_native`)
      and fp32 elsewhere; ``"bf16"`` or ``"fp32"`` force one. Weights, optimizer and loss sums stay fp32.
    - ``fused``: a fused SGD (one kernel for all parameters) where PyTorch has one, else the multi-tensor ``foreach``.
    - ``momentum``, ``nesterov``, ``weight_decay`` (on conv/linear weights only), ``label_smoothing`` of the loss.
    - ``warmup``: the learning rate rises linearly over this fraction of all steps to ``lr``, then decays to 0 along a
      cosine; ``None`` keeps ``lr`` constant.
    - ``compile``: ``torch.compile`` the model; ``None`` means on GPUs and off on CPUs (there a cold compile takes
      minutes, and benchmarks/train_throughput.py measured no gain over eager mode).
    - ``cuda_graphs``: replay forward and backward as CUDA graphs (``torch.compile(mode="reduce-overhead")``);
      ``None`` means whenever the model is compiled on a GPU.
    - ``warmup_steps``: forward/backward passes on one batch before the clock starts, when compiling, so that
      compilation and graph capture are not timed; weights, batch-norm statistics and gradients are restored after.
    - ``drop_last``: skip a last, smaller training batch (``None``: when compiling, so one graph shape suffices).
    """

    resident: bool = True
    channels_last: bool = True
    precision: str = "auto"
    fused: bool = True
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-4
    label_smoothing: float = 0.1
    warmup: float = 0.2
    compile: bool = None
    cuda_graphs: bool = None
    warmup_steps: int = 3
    drop_last: bool = None

    def resolve(self, device):
        """These settings for ``device``, every ``"auto"``/``None`` decided; a clear error for a bad value."""
        device = torch.device(device)
        cuda = device.type == "cuda"
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"FastPath(precision={self.precision!r}): use 'auto', 'bf16' or 'fp32'.")
        for name, lo, hi in (("momentum", 0, 1), ("label_smoothing", 0, 1)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and lo <= v < hi):
                raise ValueError(f"FastPath({name}={v!r}): use a number in [{lo}, {hi}).")
        if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
            raise ValueError(f"FastPath(weight_decay={self.weight_decay!r}): use a number >= 0 such as 5e-4.")
        if self.warmup is not None and not (isinstance(self.warmup, (int, float)) and 0 <= self.warmup < 1):
            raise ValueError(f"FastPath(warmup={self.warmup!r}): use a fraction of the steps in [0, 1), or None "
                             "for a constant learning rate.")
        if not (isinstance(self.warmup_steps, int) and self.warmup_steps >= 0):
            raise ValueError(f"FastPath(warmup_steps={self.warmup_steps!r}): use an int >= 0.")
        if self.cuda_graphs and not cuda:
            raise ValueError(tr(f"FastPath(cuda_graphs=True) needs a CUDA GPU, but training runs on {device}. "
                                "Leave cuda_graphs=None: it is then used on GPUs only.",
                                f"FastPath(cuda_graphs=True) には CUDA の GPU が必要ですが、訓練は {device} で実行されます。"
                                "cuda_graphs=None のままにすると GPU のときだけ使われます。"))
        if self.cuda_graphs and self.compile is False:
            raise ValueError("FastPath(cuda_graphs=True, compile=False): CUDA graphs are captured through "
                             "torch.compile(mode='reduce-overhead'); set compile=True or leave it None.")
        compile_ = cuda if self.compile is None else bool(self.compile)
        graphs = compile_ and cuda if self.cuda_graphs is None else bool(self.cuda_graphs)
        precision = self.precision
        if precision == "auto":
            precision = "bf16" if bf16_native(device) else "fp32"
        return replace(self, precision=precision, compile=compile_, cuda_graphs=graphs,
                       drop_last=compile_ if self.drop_last is None else bool(self.drop_last))

    def to_dict(self):
        """Plain data, e.g. for a results JSON."""
        return asdict(self)


def as_fast_path(fast):
    """``None``/``False`` -> None (the classic loop), ``True`` -> ``FastPath()``, a ``FastPath`` -> itself."""
    if fast is None or fast is False:
        return None
    if fast is True:
        return FastPath()
    if isinstance(fast, FastPath):
        return fast
    raise ValueError(tr(f"fast={fast!r}: use False, True or mparlib.train.FastPath(...).",
                        f"fast={fast!r}: False、True、または mparlib.train.FastPath(...) を渡してください。"))


def make_fast_optimizer(net, lr, fast):
    """SGD with (Nesterov) momentum, decay on weights only, fused where possible. Explained in 07_performance."""
    decay = [p for p in net.parameters() if p.ndim > 1]  # conv and linear weights
    other = [p for p in net.parameters() if p.ndim <= 1]  # biases, batch-norm scales and shifts
    groups = [g for g in (dict(params=decay, weight_decay=fast.weight_decay), dict(params=other, weight_decay=0.0))
              if g["params"]]
    kw = dict(lr=lr, momentum=fast.momentum, nesterov=fast.nesterov and fast.momentum > 0)
    if fast.fused:
        try:
            return torch.optim.SGD(groups, fused=True, **kw)
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype
            pass
    return torch.optim.SGD(groups, foreach=True, **kw)


def warmup_cosine(optimizer, total_steps, warmup):
    """Linear warm-up over the fraction ``warmup`` of the steps, then cosine decay to 0. Explained in 07_performance."""
    rise = max(1, round(warmup * total_steps))

    def factor(step):  # multiplies the optimizer's lr; step 0 is the first step
        if step < rise:
            return (step + 1) / rise
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - rise + 1) / (total_steps - rise + 1))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def move_batch_fast(X, y, device, channels_last=True):
    """:func:`move_batch`, then the images in NHWC layout (no copy for data already on ``device``)."""
    X, y = move_batch(X, y, device)
    return (X.contiguous(memory_format=torch.channels_last) if channels_last else X), y


def _warm_up(model, module, X, y, loss_fn, autocast, steps, graphs):
    """Compile (and capture CUDA graphs) on one batch outside the clock, then restore the model's state."""
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for _ in range(steps):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with autocast():
            loss = loss_fn(model(X), y)
        loss.backward()  # no optimizer step: the weights do not move
    module.load_state_dict(saved)  # batch-norm running statistics as before (copied in place)
    for p in module.parameters():
        p.grad = None


# --- history -------------------------------------------------------------------------------------------------

@dataclass
class History:
    """What :func:`train` measured, one entry per finished epoch. Explained in 05_multi_gpu_resnet.

    ``seconds`` is the training time of each epoch (data loading included, evaluation excluded, as in d2l);
    ``images_per_s`` the training throughput. ``interrupted`` is True when Ctrl-C ended the run early.
    """

    devices: list
    batch_size: int = None
    lr: float = None
    train_loss: list = field(default_factory=list)
    train_acc: list = field(default_factory=list)
    test_acc: list = field(default_factory=list)
    seconds: list = field(default_factory=list)
    images_per_s: list = field(default_factory=list)
    interrupted: bool = False
    fast: dict = None  # the resolved FastPath settings (and the untimed warm-up's seconds), None for the classic loop

    @property
    def epochs(self):
        """Number of finished epochs."""
        return len(self.test_acc)

    def sec_per_epoch(self):
        """Mean training seconds per finished epoch."""
        return sum(self.seconds) / len(self.seconds) if self.seconds else float("nan")

    def summary(self):
        """d2l's one-line result: ``test acc: 0.91, 12.3 sec/epoch on [device(type='cuda', index=0)]``."""
        if not self.test_acc:
            return tr("no epoch finished", "終了したエポックはありません")
        return f"test acc: {self.test_acc[-1]:.2f}, {self.sec_per_epoch():.1f} sec/epoch on {self.devices}"

    def to_dict(self):
        """Plain data (devices as strings), e.g. for ``json.dump``."""
        d = asdict(self)
        d["devices"] = [str(dev) for dev in self.devices]
        return d


# --- the loop ------------------------------------------------------------------------------------------------

def _quiet():
    return "PYTEST_CURRENT_TEST" in os.environ or bool(os.environ.get("MPARLIB_QUIET"))


def _progress(iterable, total, desc, enabled):
    """A tqdm bar over the batches, or None. ``enabled=None``: in a terminal, or in Jupyter with ipywidgets."""
    import importlib.util

    from .plot import in_kernel

    kernel = in_kernel()
    widgets = kernel and importlib.util.find_spec("ipywidgets") is not None
    if enabled is None:
        tty = getattr(sys.stderr, "isatty", None)
        enabled = not _quiet() and (widgets or (not kernel and tty is not None and tty()))
    if not enabled:
        return None
    if widgets:
        from tqdm.auto import tqdm
    else:  # a text bar; also in a kernel without ipywidgets, where tqdm.auto would fail
        from tqdm.std import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False, unit="batch", file=sys.stderr)


def _load_data(data, batch_size, **defaults):
    if isinstance(data, (tuple, list)) and len(data) == 2:
        return data
    if data is not None and not isinstance(data, dict):
        raise ValueError(tr("data must be None, a dict of load_fashion_mnist arguments, or (train_iter, test_iter).",
                            "data には None、load_fashion_mnist の引数の dict、または (train_iter, test_iter) を渡してください。"))
    if batch_size is None:
        raise ValueError(tr("Give batch_size=... so that the data can be loaded.",
                            "データを読み込むために batch_size=... を指定してください。"))
    from .data import load_fashion_mnist

    return load_fashion_mnist(batch_size, **{**defaults, **(data or {})})  # the caller's arguments win


def make_animator(num_epochs, path=None):
    """The live plot of :func:`train`: train loss, train and test accuracy against epochs, in the notebook's language."""
    from .plot import Animator

    return Animator(xlabel=tr("epoch", "エポック"), xlim=[0, num_epochs],
                    legend=[tr("train loss", "訓練損失"), tr("train acc", "訓練精度"), tr("test acc", "テスト精度")],
                    fmts=("-", "m--", "g-o"), path=path)


def train(net, devices=None, *, batch_size=None, lr, num_epochs, data=None, animator=True, init=True,
          progress=None, verbose=True, fast=None):
    """Train ``net`` with SGD and cross-entropy on ``devices``; return a :class:`History`. Explained in 05_multi_gpu_resnet.

    - ``devices``: a list of devices (default ``mparlib.try_all_gpus()``), checked by :func:`check_devices`. The
      model is moved to ``devices[0]``; with several GPUs it is wrapped in ``nn.DataParallel``.
    - ``data``: ``(train_iter, test_iter)``, or ``None``/a dict of arguments for
      ``mparlib.data.load_fashion_mnist(batch_size, ...)``.
    - ``init=True`` draws conv/linear weights from N(0, 0.01^2) as d2l does, lazy layers included
      (see :func:`mparlib.models.init_weights`); ``init=False`` keeps the weights (e.g. to continue training).
    - ``animator``: True for the live plot, False for none, or an ``Animator`` (e.g. with ``path="run.png"``).
    - ``progress``: a tqdm bar over batches; ``None`` shows it in a terminal (or in Jupyter with ipywidgets).
    - Prints d2l's one-line summary unless ``verbose=False``. Ctrl-C returns the epochs finished so far.
    - ``fast``: ``True`` or a :class:`FastPath` trains on one device with the fast helpers of 07_performance (``lr``
      is then the peak of the schedule); the epoch loop, the evaluation and the history stay the same.
    """
    devices = check_devices(devices)
    if not (isinstance(num_epochs, int) and num_epochs > 0):
        raise ValueError(f"num_epochs={num_epochs!r}: use a positive int.")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr={lr!r}: use a positive learning rate such as 0.1.")
    fast = as_fast_path(fast)
    if fast is not None:
        if len(devices) > 1:
            raise ValueError(tr(f"The fast path trains on one device; got {devices}. Use devices=[{str(devices[0])!r}] "
                                "(several GPUs train together with DistributedDataParallel, chapter 06_ddp).",
                                f"高速パスは 1つのデバイスで訓練します（指定: {devices}）。devices=[{str(devices[0])!r}] "
                                "を渡してください（複数 GPU での訓練は 06_ddp 章の DistributedDataParallel で行います）。"))
        fast = fast.resolve(devices[0])
    resident = dict(resident=True, device=devices[0]) if fast is not None and fast.resident else {}
    train_iter, test_iter = _load_data(data, batch_size, **resident)
    module = unwrap(net).to(devices[0])  # parameters on devices[0] before any wrapping
    if init:
        example = None
        if lazy_modules(module):
            example = next(iter(test_iter))[0][:1].to(devices[0])  # one image to create the lazy parameters
        init_weights(module, example)
    model = nn.DataParallel(module, device_ids=devices) if len(devices) > 1 else module
    num_batches = len(train_iter) if hasattr(train_iter, "__len__") else None
    cudnn_benchmark = torch.backends.cudnn.benchmark  # the fast path turns it on for a GPU; restored at the end
    if fast is None:
        optimizer, scheduler = make_optimizer(model, lr), None
        loss_fn = nn.CrossEntropyLoss()
        mover, autocast, step_model, full_batch = move_batch, (lambda: autocast_context(devices[0])), model, None
        marks = {max(1, num_batches * k // 5) for k in range(1, 6)} if num_batches else set()  # 5 points per epoch
    else:
        try:
            optimizer, scheduler, loss_fn, mover, autocast, step_model, full_batch, warm = _fast_setup(
                module, devices[0], fast, lr, num_epochs, batch_size, train_iter, test_iter)
        except BaseException:
            torch.backends.cudnn.benchmark = cudnn_benchmark
            raise
        marks = set()  # no mid-epoch plot points: reading the running sums would wait for the device
    if animator is True:
        animator = make_animator(num_epochs)
    history = History(devices=devices, batch_size=batch_size, lr=lr,
                      fast=None if fast is None else {**fast.to_dict(), "warmup_seconds": warm})
    done = 0
    try:
        for epoch in range(num_epochs):
            model.train()
            loss_total = torch.zeros((), device=devices[0])  # sums stay on the device: no sync per batch
            correct_total = torch.zeros((), dtype=torch.int64, device=devices[0])
            count, done = 0, 0
            timer = Timer(devices[0])  # laps: plotting in the middle of an epoch is not timed
            bar = _progress(train_iter, num_batches, f"epoch {epoch + 1}/{num_epochs}", progress)
            timer.start()
            try:
                for i, (X, y) in enumerate(bar if bar is not None else train_iter):
                    if fast is not None and fast.drop_last:
                        full_batch = full_batch or len(y)
                        if len(y) != full_batch:
                            continue  # a smaller last batch would need another compiled graph
                    X, y = mover(X, y, devices[0])
                    if fast is not None and fast.cuda_graphs:
                        torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are done
                    loss_sum, correct, n = train_step(step_model, X, y, loss_fn, optimizer, autocast)
                    if scheduler is not None:
                        scheduler.step()
                    loss_total += loss_sum
                    correct_total += correct
                    count, done = count + n, i + 1
                    if animator and done in marks and done < num_batches:
                        timer.stop()
                        animator.add(epoch + done / num_batches,
                                     (float(loss_total) / count, int(correct_total) / count, None))
                        timer.start()
            finally:
                if bar is not None:
                    bar.close()
            timer.stop()
            if count == 0:
                raise ValueError(tr("The training iterator yielded no batch.",
                                    "訓練用のイテレータがバッチを1つも返しませんでした。"))
            seconds = timer.sum()
            test_acc = evaluate_accuracy(model, test_iter, devices)  # the eager model, fp32
            history.train_loss.append(float(loss_total) / count)
            history.train_acc.append(int(correct_total) / count)
            history.test_acc.append(test_acc)
            history.seconds.append(seconds)
            history.images_per_s.append(count / seconds)
            if animator:
                animator.add(epoch + 1, (history.train_loss[-1], history.train_acc[-1], test_acc))
    except KeyboardInterrupt:
        history.interrupted = True
        if verbose:
            print(tr(f"Interrupted in epoch {history.epochs + 1} after {done} batch(es); returning the "
                     f"{history.epochs} finished epoch(s).",
                     f"{history.epochs + 1}エポック目の {done}バッチを処理したところで中断しました。終了した "
                     f"{history.epochs}エポック分の記録を返します。"), flush=True)
    finally:
        torch.backends.cudnn.benchmark = cudnn_benchmark
    if verbose and history.epochs:
        print(history.summary(), flush=True)
    return history


def _fast_setup(module, device, fast, lr, num_epochs, batch_size, train_iter, test_iter):
    """Everything the fast path changes, before the first epoch: model layout, optimizer, schedule, compile."""
    if fast.channels_last:
        module.to(memory_format=torch.channels_last)
    optimizer = make_fast_optimizer(module, lr, fast)
    num_batches = len(train_iter) if hasattr(train_iter, "__len__") else None
    full_batch = None  # with drop_last: the size of the batches kept (None: that of the first batch)
    if fast.drop_last and batch_size:
        full_batch = batch_size
        if num_batches is not None and hasattr(train_iter, "dataset"):
            num_batches = len(train_iter.dataset) // full_batch
            if num_batches == 0:
                raise ValueError(tr(f"drop_last leaves no batch: {len(train_iter.dataset)} training examples, batch "
                                    f"size {full_batch}. Use a smaller batch or FastPath(drop_last=False).",
                                    f"drop_last ではバッチが残りません（訓練データ {len(train_iter.dataset)}件、バッチ"
                                    f"サイズ {full_batch}）。バッチを小さくするか FastPath(drop_last=False) にしてください。"))
    scheduler = None
    if fast.warmup is not None:
        if num_batches is None:
            raise ValueError("FastPath(warmup=...) needs len(train_iter) to plan the schedule; pass warmup=None "
                             "for a constant learning rate.")
        scheduler = warmup_cosine(optimizer, num_epochs * num_batches, fast.warmup)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=fast.label_smoothing)
    dtype = torch.bfloat16 if fast.precision == "bf16" else None

    def autocast():
        return autocast_context(device, dtype)

    def mover(X, y, dev):
        return move_batch_fast(X, y, dev, fast.channels_last)

    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # pick the fastest convolution algorithm for each shape once
    step_model, warm = module, 0.0
    if fast.compile:
        step_model = torch.compile(module, mode="reduce-overhead" if fast.cuda_graphs else None, dynamic=False)
        if fast.warmup_steps:
            X_t, y_t = next(iter(test_iter))  # not the training iterator: its shuffling order stays untouched
            rows = torch.arange(full_batch or len(y_t)) % len(y_t)  # test images repeated to a training batch
            X, y = mover(X_t[rows], y_t[rows], device)
            timer = Timer(device)
            module.train()
            try:
                with timer:
                    _warm_up(step_model, module, X, y, loss_fn, autocast, fast.warmup_steps, fast.cuda_graphs)
            except Exception as e:
                raise RuntimeError(tr(
                    f"torch.compile failed on {device} ({type(e).__name__}: {e}). Train without it: "
                    "fast=FastPath(compile=False).",
                    f"{device} で torch.compile が失敗しました（{type(e).__name__}: {e}）。"
                    "fast=FastPath(compile=False) でコンパイルせずに訓練してください。")) from e
            warm = timer.sum()
    return optimizer, scheduler, loss_fn, mover, autocast, step_model, full_batch, warm


# --- the chapter-5 experiment as a script ------------------------------------------------------------------

SMOKE = dict(subset=(1280, 256), num_epochs=1, batch_size=16, lr=0.05)  # the notebook's quick check on a CPU
FULL = dict(subset=None, num_epochs=10, batch_size=256, lr=0.1)  # d2l's one-GPU run


def main(argv=None):
    """``python -m mparlib.train``: train ResNet-18 on Fashion-MNIST and write the plot to a PNG. Explained in 05_multi_gpu_resnet."""
    defaults = FULL if profile() == "full" else SMOKE
    ap = argparse.ArgumentParser(
        prog="python -m mparlib.train",
        description="Train the course's ResNet-18 on Fashion-MNIST on one or several GPUs (chapter 05_multi_gpu_resnet) "
                    "and write the live plot to a PNG file. Defaults follow the course profile "
                    f"(now {profile()!r}; set MPARLIB_PROFILE=smoke|full to change it).",
        epilog="d2l's two runs: `--gpus 1 --batch-size 256 --lr 0.1` and `--gpus 2 --batch-size 512 --lr 0.2`.")
    ap.add_argument("--gpus", type=int, default=None,
                    help="number of GPUs to use (error if fewer exist); default: all GPUs, or the CPU without one")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs exist")
    ap.add_argument("--batch-size", type=int, default=defaults["batch_size"],
                    help="global batch size, split over the GPUs (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=defaults["lr"], help="SGD learning rate (default: %(default)s)")
    ap.add_argument("--epochs", type=int, default=defaults["num_epochs"], help="number of epochs (default: %(default)s)")
    ap.add_argument("--subset", type=int, nargs="*", default=None, metavar="N",
                    help="train on the first N images (and N//6 test images), or give N_TRAIN N_TEST; "
                         f"default: {defaults['subset'] or 'all 60,000 / 10,000'}")
    ap.add_argument("--data", default=None, help="folder holding the Fashion-MNIST files (default: searched)")
    ap.add_argument("--plot", default="resnet18_fashion_mnist.png", help="PNG file for the plot (default: %(default)s)")
    ap.add_argument("--json", default=None, help="also write the history as JSON to this file")
    ap.add_argument("--overwrite", action="store_true", help="replace --plot/--json files that already exist")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights and the data order (default: 0)")
    ap.add_argument("--fast", action="store_true",
                    help="the fast path of 07_performance on one device: resident data, channels_last, bf16 where "
                         "native, fused SGD with momentum and a warm-up + cosine schedule, torch.compile on GPUs")
    args = ap.parse_args(argv)

    if args.gpus is not None and args.cpu:
        ap.error("use either --gpus N or --cpu")
    for option, path in (("--plot", args.plot), ("--json", args.json)):
        if path and Path(path).exists() and not args.overwrite:
            ap.error(f"{path} exists; choose another {option} file or pass --overwrite to replace it")
    if args.subset is None:
        subset = defaults["subset"]
    elif len(args.subset) in (1, 2):
        subset = args.subset[0] if len(args.subset) == 1 else tuple(args.subset)
    else:
        ap.error("--subset takes N or N_TRAIN N_TEST")
    try:
        if args.cpu:
            devices = [torch.device("cpu")]
        elif args.gpus is not None:
            if args.gpus < 1:
                ap.error("--gpus must be at least 1")
            devices = require_gpus(args.gpus)
        else:
            devices = try_all_gpus()
        torch.manual_seed(args.seed)
        net = resnet18(10)
        data = dict(subset=subset, root=args.data, shuffle_seed=args.seed)
        history = train(net, devices[:1] if args.fast else devices, batch_size=args.batch_size, lr=args.lr,
                        num_epochs=args.epochs, data=data, animator=make_animator(args.epochs, path=args.plot),
                        progress=None, fast=args.fast or None)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        from .files import atomic_write_bytes

        atomic_write_bytes(args.json, (json.dumps(history.to_dict(), indent=1) + "\n").encode())
    print(f"plot: {args.plot}" + (f", history: {args.json}" if args.json else ""))
    return 130 if history.interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
