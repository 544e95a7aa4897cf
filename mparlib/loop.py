"""The epoch loop: train a classifier on one or several devices, d2l style but robust. Explained in 05_multi_gpu_resnet.

:func:`train` moves the model to ``devices[0]``, wraps it (``mparlib.step.wrap_model``: ``nn.DataParallel`` over
several GPUs, the course's ``data_parallel`` over one device listed k times), initialises its weights, trains with
SGD, plots train loss and accuracies live, and returns a :class:`History`. Ctrl-C ends training early and still
returns the epochs done; a loss that becomes NaN or infinite raises :class:`mparlib.errors.TrainingDiverged`. The
loop runs whatever ``mparlib.step.StepPlan`` it is given: chapter 05's (``classic_plan``), or with
``train(..., fast=True)`` the fast path of 07_performance (``mparlib.fastpath.plan``). The script is ``mparlib.train``.
"""
import collections.abc
import contextlib
import copy
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from . import fastpath
from .checkpoint import unwrap
from .checks import finite_float, positive_int
from .data import load_fashion_mnist
from .devices import check_devices, try_all_gpus
from .errors import ConfigError, DeviceError, TrainingDiverged
from .lang import tr
from .models import init_weights, lazy_modules
from .parallel import scatter
from .plot import Animator
from .progress import progress_bar
from .step import classic_plan, train_step, wrap_model
from .timing import Timer


def _training_devices(devices):
    """The course's one device rule, then training's own: distinct GPUs (``nn.DataParallel`` splits a batch over
    CUDA devices only), or one device listed k times (k simulated devices, split by ``mparlib.parallel``)."""
    devices = check_devices(devices)
    if len(set(devices)) == 1:
        return devices
    if devices[0].type != "cuda":
        raise DeviceError(tr(
            f"nn.DataParallel splits a batch over CUDA GPUs only, so {devices} cannot be used together. "
            "Train on one device, e.g. devices=[torch.device('cpu')], or simulate several devices on the CPU with "
            "devices=['cpu'] * 2 (mparlib.parallel.data_parallel splits each batch, as in 03_primitives).",
            f"nn.DataParallel がミニバッチを分配できるのは CUDA の GPU だけなので、{devices} はまとめて使えません。"
            "devices=[torch.device('cpu')] のように 1つのデバイスで訓練するか、devices=['cpu'] * 2 として CPU 上で"
            "複数のデバイスを模擬してください（3章と同じく mparlib.parallel.data_parallel が各バッチを分けます）。"))
    if len(set(devices)) != len(devices):
        raise DeviceError(tr(f"A device appears twice in {devices}: list each device once.",
                             f"{devices} に同じデバイスが 2回あります。各デバイスは 1回だけ指定してください。"))
    return devices


def _described(obj):
    if isinstance(obj, torch.Tensor):
        return tr(f"a tensor of shape {tuple(obj.shape)}", f"形状 {tuple(obj.shape)} のテンソル")
    return tr(type(obj).__name__, f"型 {type(obj).__name__} のオブジェクト")


def _pair(batch, what):
    """One batch as ``(X, y)``, or a ConfigError saying what the iterator yielded instead."""
    if not isinstance(batch, torch.Tensor):
        with contextlib.suppress(TypeError, ValueError):
            X, y = batch
            return X, y
    shown = _described(batch)
    raise ConfigError(tr(f"{what} yielded {shown}; each batch must be a pair (images, labels), as a DataLoader over "
                         "a data set of (image, label) items gives.",
                         f"{what} が{shown}を返しました。各バッチは (画像, ラベル) の組でなければなりません"
                         "（(画像, ラベル) を返すデータセットの DataLoader が返す形です）。"))


def _no_batch(what, why_en="", why_ja=""):
    return ConfigError(tr(f"{what} yielded no batch{why_en}: give it at least one (images, labels) batch.",
                          f"{what} がバッチを 1つも返しませんでした{why_ja}。(画像, ラベル) のバッチを 1つ以上"
                          "返すようにしてください。"))


def evaluate_accuracy(net, data_iter, devices=None):
    """Fraction of correct predictions, each batch split over ``devices``. Explained in 05_multi_gpu_resnet.

    Like d2l's ``evaluate_accuracy_gpus``: every device gets a shard of each batch and a copy of the model (in
    evaluation mode, so batch norm uses its running statistics and the shards do not change the result); the
    correct predictions of the shards are summed. ``devices`` defaults to the device of the model's parameters.
    """
    module = _plain_model(net)
    devices = _training_devices([next(module.parameters()).device] if devices is None else devices)
    lazy = lazy_modules(module)
    if lazy:
        raise ConfigError(tr(f"The model still has lazy layers (e.g. {lazy[0]!r}): run one forward pass or "
                             "mparlib.models.init_weights(net, example_batch) first.",
                             f"モデルにまだ遅延層があります（例: {lazy[0]!r}）。先に順伝播を 1回実行するか、"
                             "mparlib.models.init_weights(net, example_batch) を呼んでください。"))
    return _accuracy(module, data_iter, devices)


def _accuracy(module, data_iter, devices):
    """:func:`evaluate_accuracy` of a plain, initialised module on checked devices."""
    was_training = module.training
    module.eval()
    home = next(module.parameters()).device
    replicas = [module if d == home else copy.deepcopy(module).to(d) for d in devices]  # one copy per other device
    correct = [torch.zeros((), dtype=torch.int64, device=d) for d in devices]  # summed on each device, no sync
    count = 0
    try:
        with torch.no_grad():
            for batch in data_iter:
                X, y = _pair(batch, "test_iter")
                X_shards, y_shards = scatter(X, devices), scatter(y, devices)  # torch.chunk sizes
                for i, (replica, Xs, ys) in enumerate(zip(replicas, X_shards, y_shards)):
                    correct[i] += (replica(Xs).argmax(dim=1) == ys).sum()  # (B_i, classes) -> (B_i,)
                count += len(y)
    finally:
        module.train(was_training)
    if count == 0:
        raise _no_batch("test_iter")
    return sum(int(c) for c in correct) / count


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
        acc, sec = self.test_acc[-1], self.sec_per_epoch()
        return tr(f"test acc: {acc:.2f}, {sec:.1f} sec/epoch on {self.devices}",
                  f"テスト精度: {acc:.2f}、1エポック {sec:.1f}秒、デバイス: {self.devices}")

    def to_dict(self):
        """Plain data (devices as strings), e.g. for ``json.dump``."""
        d = asdict(self)
        d["devices"] = [str(dev) for dev in self.devices]
        return d

    @staticmethod
    def live_plot(num_epochs, path=None):
        """The live plot of :func:`train`: train loss, train and test accuracy per epoch, in the notebook's language
        (``path``: also written to that PNG file at every update)."""
        return Animator(xlabel=tr("epoch", "エポック"), xlim=[0, num_epochs],
                        legend=[tr("train loss", "訓練損失"), tr("train acc", "訓練精度"), tr("test acc", "テスト精度")],
                        fmts=("-", "m--", "g-o"), path=path)


def _plain_model(net):
    """The plain module under ``net``, checked to be a model with real parameters."""
    if not isinstance(net, nn.Module):
        raise ConfigError(tr(f"net={type(net).__name__}: pass a torch.nn.Module, e.g. mparlib.models.resnet18(10).",
                             f"net={type(net).__name__}: mparlib.models.resnet18(10) のような torch.nn.Module を渡して"
                             "ください。"))
    module = unwrap(net)
    params = list(module.parameters())
    if not params or any(p.is_meta for p in params):
        raise ConfigError(tr(f"{type(module).__name__} has no parameters with values (none at all, or on the meta "
                             "device): build the model on a real device, or call net.to_empty(device='cpu') first.",
                             f"{type(module).__name__} には値のあるパラメータがありません（1つもないか、meta デバイス上に"
                             "あります）。実際のデバイス上でモデルを作るか、先に net.to_empty(device='cpu') を呼んで"
                             "ください。"))
    return module


def _check_iterable(it, name):
    if isinstance(it, torch.Tensor) or not isinstance(it, collections.abc.Iterable):
        got = _described(it)
        raise ConfigError(tr(f"{name} is {got}; it must yield (images, labels) batches, e.g. "
                             "torch.utils.data.DataLoader(TensorDataset(X, y), batch_size) or a list of (X, y) pairs.",
                             f"{name} が{got}です。(画像, ラベル) のバッチを返すもの、たとえば "
                             "torch.utils.data.DataLoader(TensorDataset(X, y), batch_size) や (X, y) の組のリストを"
                             "渡してください。"))
    if isinstance(it, collections.abc.Iterator):
        raise ConfigError(tr(f"{name} is a one-pass iterator ({type(it).__name__}), but train() reads it once per "
                             "epoch: pass something that can be iterated again, such as a DataLoader or a list.",
                             f"{name} は 1回しか走査できないイテレータ（{type(it).__name__}）ですが、train() は"
                             "エポックごとに読み直します。DataLoader やリストのように何度でも走査できるものを渡して"
                             "ください。"))
    if isinstance(it, collections.abc.Sized) and len(it) == 0:
        raise _no_batch(name)  # before any training, not after the first epoch


def _load_data(data, batch_size, **defaults):
    if isinstance(data, (tuple, list)) and len(data) == 2:
        for it, name in zip(data, ("train_iter", "test_iter")):
            _check_iterable(it, name)
        return data
    if data is not None and not isinstance(data, dict):
        raise ConfigError(tr("data must be None, a dict of load_fashion_mnist arguments, or (train_iter, test_iter).",
                             "data には None、load_fashion_mnist の引数の dict、または (train_iter, test_iter) を渡して"
                             "ください。"))
    if batch_size is None:
        raise ConfigError(tr("Give batch_size=... so that the data can be loaded.",
                             "データを読み込むために batch_size=... を指定してください。"))
    return load_fashion_mnist(batch_size, **{**defaults, **(data or {})})  # the caller's arguments win


class _Sums:
    """One epoch's running sums, kept on the device: adding to them never waits for it, reading them does."""

    def __init__(self, device, epoch):
        self.epoch = epoch  # counted from 1
        self.loss = torch.zeros((), device=device)  # sum of the examples' losses (fp32)
        self.correct = torch.zeros((), dtype=torch.int64, device=device)
        self.count = self.done = 0  # examples trained on; batches drawn until the last step
        self.read = 0.0  # the loss sum at the last check
        self.unchecked = []  # (step, loss sum of that step) since the last check

    def add(self, step, loss_sum, correct, n):
        self.loss += loss_sum
        self.correct += correct
        self.count, self.done = self.count + n, step
        self.unchecked.append((step, loss_sum))  # a reference, no copy and no sync

    def check(self):
        """Mean loss so far (waits for the device); TrainingDiverged naming the first step whose loss is not finite."""
        total = float(self.loss)
        if not math.isfinite(total):  # once NaN or inf, a sum stays so: find the step where it began
            steps = [s for s, _ in self.unchecked]
            losses = torch.stack([v for _, v in self.unchecked]).float()
            bad = ~torch.isfinite(losses)
            if not bad.any():  # every loss finite, but so large that their sum overflowed
                bad = ~torch.isfinite(self.read + torch.cumsum(losses, 0))
            k = int(bad.int().argmax())
            value = float(losses[k])
            raise TrainingDiverged(tr(
                f"The training loss became {value} in epoch {self.epoch}, step {steps[k]}; training stopped. Lower "
                "the learning rate, check that the inputs hold no NaN or inf (torch.isfinite(X).all()), and check the "
                "model's forward pass. The epochs finished before are in this error's .history.",
                f"{self.epoch}エポック目のステップ {steps[k]} で訓練損失が {value} になったため、訓練を止めました。"
                "学習率を下げてください。また、入力に NaN や inf がないか（torch.isfinite(X).all()）、モデルの"
                "順伝播に問題がないかを確かめてください。それまでに終わったエポックの記録はこのエラーの .history に"
                "あります。"))
        self.read, self.unchecked = total, []
        return total / max(self.count, 1)


def _train_epoch(step, train_iter, device, sums, num_epochs, animator, progress):
    """One pass over ``train_iter`` with the plan's step; returns its training seconds (plotting not timed)."""
    num_batches = len(train_iter) if hasattr(train_iter, "__len__") else None
    points = step.plot_points if num_batches else 0
    marks = {max(1, num_batches * k // points) for k in range(1, points + 1)} if points else set()
    bar = progress_bar(train_iter, num_batches, f"epoch {sums.epoch}/{num_epochs}", progress)
    timer = Timer(device)
    timer.start()
    try:
        for i, batch in enumerate(bar if bar is not None else train_iter):
            X, y = _pair(batch, "train_iter")
            if step.batch_size is not None and len(y) != step.batch_size:
                continue  # e.g. a smaller last batch, which would need another compiled graph
            X, y = step.prepare(X, y, device)
            if step.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()  # the previous step's graph outputs are done with
            sums.add(i + 1, *train_step(step.model, X, y, step.loss_fn, step.optimizer, step.autocast))
            if step.scheduler is not None:
                step.scheduler.step()
            if sums.done in marks:  # read the sums here only: reading waits for the device
                timer.stop()
                loss = sums.check()
                if animator and sums.done < num_batches:
                    animator.add(sums.epoch - 1 + sums.done / num_batches, (loss, int(sums.correct) / sums.count, None))
                timer.start()
    finally:
        if bar is not None:
            bar.close()
    timer.stop()
    if sums.count == 0:
        n = step.batch_size
        raise _no_batch("train_iter", *(() if n is None else (
            f" of size {n} (batches of another size are skipped: FastPath(drop_last=True))",
            f"（サイズ {n} 以外のバッチは飛ばされます: FastPath(drop_last=True)）")))
    return timer.sum()


def train(net, devices=None, *, batch_size=None, lr, num_epochs, data=None, animator=True, init=True,
          progress=None, verbose=True, fast=None):
    """Train ``net`` with SGD and cross-entropy on ``devices``; a :class:`History`. Explained in 05_multi_gpu_resnet.

    - ``devices``: a list of devices (default ``mparlib.try_all_gpus()``), checked once by ``mparlib.check_devices``:
      distinct GPUs, or one device listed k times. The model is moved to ``devices[0]``; with several GPUs it is
      wrapped in ``nn.DataParallel``, with one device listed k times in ``mparlib.step.SimulatedDataParallel``
      (k simulated devices).
    - ``data``: ``(train_iter, test_iter)``, each iterable once per epoch, or ``None``/a dict of arguments for
      ``mparlib.data.load_fashion_mnist(batch_size, ...)``.
    - ``init=True`` draws conv/linear weights from N(0, 0.01^2) as d2l does, lazy layers included
      (see :func:`mparlib.models.init_weights`); ``init=False`` keeps the weights (e.g. to continue training).
    - ``animator``: True for the live plot (:meth:`History.live_plot`), False for none, or an ``Animator``.
    - ``progress``: a tqdm bar over batches; ``None`` shows it in a terminal (or in Jupyter with ipywidgets).
    - Prints d2l's one-line summary unless ``verbose=False``. Ctrl-C returns the epochs finished so far. A loss that
      is not finite raises ``TrainingDiverged`` naming the epoch and step (its ``.history`` holds the epochs done).
    - ``fast``: ``True`` or a ``mparlib.fastpath.FastPath`` trains on one device with the fast parts of
      07_performance (``lr`` is then the peak of the schedule); the epoch loop, the evaluation and the history stay.
    """
    devices = _training_devices(try_all_gpus() if devices is None else devices)
    positive_int(num_epochs, "num_epochs", 10)
    if batch_size is not None:
        positive_int(batch_size, "batch_size", 256)
    finite_float(lr, "lr", 0.1)
    module = _plain_model(net)
    fast = fastpath.FastPath.for_train(fast, devices)  # None: the classic loop
    resident = dict(resident=True, device=devices[0]) if fast and fast.resident else {}  # FastPath(resident=True)
    train_iter, test_iter = _load_data(data, batch_size, **resident)
    module.to(devices[0])  # parameters on devices[0] before any wrapping
    if init:
        example = None
        if lazy_modules(module):  # one image creates the lazy parameters
            first = next(iter(test_iter), None)
            if first is None:
                raise _no_batch("test_iter")
            example = _pair(first, "test_iter")[0][:1].to(devices[0])
        init_weights(module, example)
    model = wrap_model(module, devices)  # the module, nn.DataParallel, or simulated devices
    step = (classic_plan(model, devices[0], lr) if fast is None else
            fastpath.plan(module, devices[0], fast, lr, num_epochs, batch_size, train_iter, test_iter))
    history = History(devices=devices, batch_size=batch_size, lr=lr, fast=step.info)
    animator = History.live_plot(num_epochs) if animator is True else animator
    with step.settings():
        _epochs(step, model, module, (train_iter, test_iter), devices, num_epochs, history, animator, progress, verbose)
    if verbose and history.epochs:
        print(history.summary(), flush=True)
    return history


def _epochs(step, model, module, data, devices, num_epochs, history, animator, progress, verbose):
    """The epochs of :func:`train`, recorded in ``history``; Ctrl-C ends them early, a non-finite loss raises."""
    train_iter, test_iter = data
    sums = None
    try:
        for epoch in range(1, num_epochs + 1):
            model.train()
            sums = _Sums(devices[0], epoch)
            seconds = _train_epoch(step, train_iter, devices[0], sums, num_epochs, animator, progress)
            loss = sums.check()
            test_acc = _accuracy(module, test_iter, devices)  # the eager, unwrapped model, fp32
            history.train_loss.append(loss)
            history.train_acc.append(int(sums.correct) / sums.count)
            history.test_acc.append(test_acc)
            history.seconds.append(seconds)
            history.images_per_s.append(sums.count / seconds)
            if animator:
                animator.add(epoch, (history.train_loss[-1], history.train_acc[-1], test_acc))
    except KeyboardInterrupt:
        history.interrupted = True
        done = sums.done if sums is not None else 0
        if verbose:
            print(tr(f"Interrupted in epoch {history.epochs + 1} after {done} batch(es); returning the "
                     f"{history.epochs} finished epoch(s).",
                     f"{history.epochs + 1}エポック目の {done}バッチを処理したところで中断しました。終了した "
                     f"{history.epochs}エポック分の記録を返します。"), flush=True)
    except TrainingDiverged as e:
        e.history = history
        raise
