"""The fast path of chapter 07: the same training loop, fed faster parts. Explained in 07_performance.

``train(..., fast=True)`` (or ``fast=FastPath(...)``) asks :func:`plan` for the loop's ``StepPlan`` (``mparlib.step``):
data resident on the device, ``channels_last``, bf16 autocast where the device computes bf16 natively, fused SGD
with momentum and a warm-up + cosine schedule, label smoothing, and optionally ``torch.compile`` with CUDA graphs.
The epoch loop, the evaluation and the :class:`mparlib.loop.History` are those of chapter 05.
"""
import contextlib
import functools
import math
import numbers
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from .checks import finite_float, flag, one_of, positive_int
from .errors import ConfigError
from .lang import tr
from .step import StepPlan, autocast_context, move_batch
from .timing import Timer


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


def _fraction(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1


@dataclass(frozen=True)
class FastPath:
    """Settings of :func:`mparlib.loop.train`'s fast path; each can be switched off alone. Explained in 07_performance.

    - ``resident``: when :func:`train` loads the data (``data`` is None or a dict), the whole set stays on the device
      as uint8 and each batch is gathered and normalised there (:class:`mparlib.data.ResidentLoader`).
    - ``channels_last``: model and batches in NHWC memory layout, the layout fast convolution kernels use.
    - ``precision``: ``"auto"`` uses bf16 autocast where the device computes bf16 natively (see :func:`bf16_native`)
      and fp32 elsewhere; ``"bf16"`` or ``"fp32"`` force one. Weights, optimizer and loss sums stay fp32.
    - ``fused``: a fused SGD (one kernel for all parameters) where PyTorch has one, else the multi-tensor ``foreach``
      (``History.fast["fused_sgd"]`` records which one ran).
    - ``momentum``, ``nesterov``, ``weight_decay`` (on conv/linear weights only), ``label_smoothing`` of the loss.
    - ``warmup``: the learning rate rises linearly over this fraction of all steps to ``lr``, then decays to 0 along a
      cosine; ``None`` keeps ``lr`` constant.
    - ``compile``: ``torch.compile`` the model; ``None`` means on GPUs and off on CPUs (there a cold compile takes
      minutes, and benchmarks/train_throughput.py measured no gain over eager mode).
    - ``cuda_graphs``: replay forward and backward as CUDA graphs (``torch.compile(mode="reduce-overhead")``);
      ``None`` means whenever the model is compiled on a GPU.
    - ``warmup_steps``: forward/backward passes on one batch before the clock starts, when compiling, so that
      compilation and graph capture are not timed; weights, batch-norm statistics and gradients are restored after.
    - ``drop_last``: skip training batches smaller than the batch size (``None``: when compiling, so that one graph
      shape suffices).
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
        """These settings for ``device``, every ``"auto"``/``None`` decided; a ConfigError for a bad value."""
        device = torch.device(device)
        cuda = device.type == "cuda"
        one_of(self.precision, "precision", ("auto", "bf16", "fp32"), "FastPath")
        for name in ("resident", "channels_last", "fused", "nesterov", "compile", "cuda_graphs", "drop_last"):
            flag(getattr(self, name), name, "FastPath", allow_none=name in ("compile", "cuda_graphs", "drop_last"))
        for name in ("momentum", "label_smoothing", "warmup"):
            value = getattr(self, name)
            if not (name == "warmup" and value is None or _fraction(value)):
                raise ConfigError(tr(f"FastPath({name}={value!r}): use a number in [0, 1)"
                                     + (", or None for a constant learning rate." if name == "warmup" else "."),
                                     f"FastPath({name}={value!r}): [0, 1) の数を指定してください"
                                     + ("（学習率を一定にするなら None）。" if name == "warmup" else "。")))
        finite_float(self.weight_decay, "weight_decay", 5e-4, "FastPath", minimum=0)
        positive_int(self.warmup_steps, "warmup_steps", 3, "FastPath", minimum=0)
        if self.cuda_graphs and not cuda:
            raise ConfigError(tr(f"FastPath(cuda_graphs=True) needs a CUDA GPU, but training runs on {device}. "
                                 "Leave cuda_graphs=None: it is then used on GPUs only.",
                                 f"FastPath(cuda_graphs=True) には CUDA の GPU が必要ですが、訓練は {device} で実行されます。"
                                 "cuda_graphs=None のままにすると GPU のときだけ使われます。"))
        if self.cuda_graphs and self.compile is False:
            raise ConfigError(tr("FastPath(cuda_graphs=True, compile=False): CUDA graphs are captured through "
                                 "torch.compile(mode='reduce-overhead'); set compile=True or leave it None.",
                                 "FastPath(cuda_graphs=True, compile=False): CUDA グラフは torch.compile(mode="
                                 "'reduce-overhead') を通して記録されます。compile=True にするか None のままにしてください。"))
        compile_ = cuda if self.compile is None else self.compile
        graphs = compile_ and cuda if self.cuda_graphs is None else self.cuda_graphs
        precision = self.precision
        if precision == "auto":
            precision = "bf16" if bf16_native(device) else "fp32"
        return replace(self, precision=precision, compile=compile_, cuda_graphs=graphs,
                       drop_last=compile_ if self.drop_last is None else self.drop_last)

    @classmethod
    def for_train(cls, fast, devices):
        """``train(fast=...)`` as resolved settings for ``devices``: None (or False) -> None, the classic loop."""
        if fast is None or fast is False:
            return None
        if fast is True:
            fast = cls()
        if not isinstance(fast, cls):
            raise ConfigError(tr(f"fast={fast!r}: use False, True or mparlib.fastpath.FastPath(...).",
                                 f"fast={fast!r}: False、True、または mparlib.fastpath.FastPath(...) を渡してください。"))
        if len(devices) > 1:
            raise ConfigError(tr(
                f"The fast path trains on one device; got {devices}. Use devices=[{str(devices[0])!r}] "
                "(several GPUs train together with DistributedDataParallel, chapter 06_ddp).",
                f"高速パスは 1つのデバイスで訓練します（指定: {devices}）。devices=[{str(devices[0])!r}] "
                "を渡してください（複数 GPU での訓練は 6章の DistributedDataParallel で行います）。"))
        return fast.resolve(devices[0])

    def to_dict(self):
        """Plain data, e.g. for a results JSON."""
        return asdict(self)


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
        except (RuntimeError, ValueError):  # no fused kernel for this device or dtype: recorded in History.fast
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
    """``move_batch``, then the images (B, C, H, W) in NHWC memory layout. Explained in 07_performance."""
    X, y = move_batch(X, y, device)
    return (X.contiguous(memory_format=torch.channels_last) if channels_last else X), y


@contextlib.contextmanager
def _cudnn_benchmark(device):
    """On a GPU, let cuDNN time its convolution algorithms once per shape; the previous setting is restored."""
    before = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = before or torch.device(device).type == "cuda"
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def plan(module, device, fast, lr, num_epochs, batch_size, train_iter, test_iter):
    """The fast path as the loop's ``StepPlan`` (compiled and warmed up if asked). Explained in 07_performance.

    ``module`` (the plain model, already on ``device``) is switched to ``channels_last`` if asked; ``fast`` are
    resolved settings (:meth:`FastPath.for_train`). The warm-up draws one test batch, never a training batch, so
    the order of the training batches stays that of the classic loop.
    """
    num_batches = len(train_iter) if hasattr(train_iter, "__len__") else None
    keep = None  # with drop_last: the only batch size trained on
    if fast.drop_last:
        keep = batch_size or getattr(train_iter, "batch_size", None)
        if keep is None:
            raise ConfigError(tr("FastPath(drop_last=True) needs the batch size: pass train(..., batch_size=...).",
                                 "FastPath(drop_last=True) にはバッチサイズが必要です。train(..., batch_size=...) を"
                                 "指定してください。"))
        if num_batches is not None and hasattr(train_iter, "dataset"):
            num_batches = len(train_iter.dataset) // keep
            if num_batches == 0:
                raise ConfigError(tr(
                    f"drop_last leaves no batch: {len(train_iter.dataset)} training examples, batch size {keep}. "
                    "Use a smaller batch or FastPath(drop_last=False).",
                    f"drop_last ではバッチが残りません（訓練データ {len(train_iter.dataset)}件、バッチサイズ {keep}）。"
                    "バッチを小さくするか FastPath(drop_last=False) にしてください。"))
    if fast.warmup is not None and not num_batches:
        raise ConfigError(tr("FastPath(warmup=...) needs len(train_iter) to plan the schedule; pass warmup=None "
                             "for a constant learning rate.",
                             "FastPath(warmup=...) で学習率のスケジュールを決めるには len(train_iter) が必要です。"
                             "学習率を一定にするなら warmup=None を指定してください。"))
    if fast.channels_last:  # the model changes only once the settings are known to work
        module.to(memory_format=torch.channels_last)
    optimizer = make_fast_optimizer(module, lr, fast)
    scheduler = None if fast.warmup is None else warmup_cosine(optimizer, num_epochs * num_batches, fast.warmup)
    loss_fn = nn.CrossEntropyLoss(label_smoothing=fast.label_smoothing)
    autocast = functools.partial(autocast_context, device, torch.bfloat16 if fast.precision == "bf16" else None)
    prepare = functools.partial(move_batch_fast, channels_last=fast.channels_last)  # (X, y, device) -> (X, y)
    settings = functools.partial(_cudnn_benchmark, device)
    step_model, warm = module, 0.0
    if fast.compile:
        with settings():
            step_model, warm = _compile(module, device, fast, keep, test_iter, loss_fn, autocast, prepare)
    fused = bool(optimizer.defaults.get("fused"))
    return StepPlan(model=step_model, optimizer=optimizer, loss_fn=loss_fn, prepare=prepare, autocast=autocast,
                    scheduler=scheduler, batch_size=keep, plot_points=0, cuda_graphs=fast.cuda_graphs,
                    settings=settings, info={**fast.to_dict(), "warmup_seconds": warm, "fused_sgd": fused})


def _compile_failed(device, error):
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return ConfigError(tr(
        f"torch.compile failed on {device} ({type(error).__name__}: {first}), although the same step runs without "
        "it. Train without compiling: fast=FastPath(compile=False). The compiler's full error is shown above.",
        f"{device} で torch.compile が失敗しました（{type(error).__name__}: {first}）。コンパイルしなければ同じ"
        "ステップは実行できます。fast=FastPath(compile=False) でコンパイルせずに訓練してください。コンパイラの"
        "エラー全体は上に表示されています。"))


def _compile(module, device, fast, batch_size, test_iter, loss_fn, autocast, prepare):
    """``torch.compile(module)`` and its untimed warm-up: (compiled module, warm-up seconds).

    A failure in the compiled warm-up is blamed on the compiler only if the same step runs eagerly: otherwise the
    eager step's own exception (a bug in the model, a wrong input) propagates unchanged.
    """
    try:
        compiled = torch.compile(module, mode="reduce-overhead" if fast.cuda_graphs else None, dynamic=False)
    except Exception as e:  # no model code has run yet: the compiler alone failed
        raise _compile_failed(device, e) from e
    if not fast.warmup_steps:
        return compiled, 0.0
    first = next(iter(test_iter), None)  # a test batch: the training iterator's shuffling order stays untouched
    if first is None:
        raise ConfigError(tr("test_iter yielded no batch, so the compiled step cannot be warmed up: give it at least "
                             "one (images, labels) batch.",
                             "test_iter がバッチを 1つも返さないので、コンパイルしたステップのウォームアップが"
                             "できません。(画像, ラベル) のバッチを 1つ以上返すようにしてください。"))
    X_t, y_t = first
    rows = torch.arange(batch_size or len(y_t)) % len(y_t)  # test images repeated to a training batch
    X, y = prepare(X_t[rows], y_t[rows], device)  # (B, 1, H, W), (B,)
    module.train()
    timer, failure = Timer(device), None
    try:
        with timer:
            warm_up(compiled, module, X, y, loss_fn, autocast, fast.warmup_steps, fast.cuda_graphs)
    except Exception as e:  # the compiler's fault or the model's? Decided below, outside this handler
        failure = e
    if failure is not None:
        warm_up(module, module, X, y, loss_fn, autocast, 1, False)  # the model's own error propagates from here
        raise _compile_failed(device, failure) from failure
    return compiled, timer.sum()


def warm_up(model, module, X, y, loss_fn, autocast, steps, graphs):
    """Forward and backward ``steps`` times on one batch, then restore the module's state. Explained in 07_performance.

    ``model`` is what runs (the compiled model), ``module`` the plain one whose batch-norm statistics and gradients
    are put back as they were, also after an error; the weights never move (no optimizer step).
    """
    saved = {k: v.detach().clone() for k, v in module.state_dict().items()}
    try:
        for _ in range(steps):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            with autocast():
                loss = loss_fn(model(X), y)
            loss.backward()  # no optimizer step: the weights do not move
    finally:
        module.load_state_dict(saved)  # batch-norm running statistics as before (copied in place)
        for p in module.parameters():
            p.grad = None
