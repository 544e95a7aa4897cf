"""``python -m mparlib.train``: chapter 05's experiment in a terminal, and its sizes. Explained in 05_multi_gpu_resnet.

Trains the course's ResNet-18 on Fashion-MNIST with :func:`mparlib.loop.train` and writes the live plot and the
history; its defaults are the chapter's runs (:func:`experiment`), which the notebook uses too. Nothing is written
into the current folder unasked: without ``--plot`` the files go into a new run folder
``runs/train-YYYYmmdd-HHMMSS/``, and a file named by ``--plot`` or ``--json`` is never replaced without
``--overwrite``. Course errors end with ``error: ...`` and exit code 2; any other exception shows its traceback.
"""
import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from .checks import positive_int
from .devices import num_gpus, profile as course_profile, require_gpus, try_all_gpus
from .errors import ConfigError, MparlibError
from .files import atomic_write_bytes
from .lang import tr
from .loop import History, train
from .models import resnet18

PER_DEVICE = {  # measured to learn; on k devices batch size and learning rate are k times these
    "full": dict(width=64, batch_size=256, lr=0.1, num_epochs=10, subset=None),  # d2l's experiment, its ResNet-18
    # about 15 s a run on two CPU cores: a narrow ResNet-18, small batches (many steps), d2l's plain SGD; 3 epochs
    # of 4,000 images reach a test accuracy of 0.73-0.75 (4 runs: 1 and 2 devices, 2 seeds)
    "smoke": dict(width=8, batch_size=16, lr=0.025, num_epochs=3, subset=(4000, 1000)),
}
PLOT_NAME, HISTORY_NAME = "resnet18_fashion_mnist.png", "history.json"  # the files of a run folder


def experiment(k=1, profile=None):
    """Chapter 05's run on ``k`` devices in a course profile (default: this one). Explained in 05_multi_gpu_resnet.

    A dict of ``width`` (for ``mparlib.models.resnet18``), ``batch_size``, ``lr``, ``num_epochs`` and ``subset`` (for
    ``mparlib.data.load_fashion_mnist``): the one-device run with batch size and learning rate multiplied by ``k``.
    """
    k = positive_int(k, "k", 2, "experiment")
    run = dict(PER_DEVICE[course_profile() if profile is None else profile])
    return {**run, "batch_size": run["batch_size"] * k, "lr": run["lr"] * k}


def _positive(kind):
    """An argparse type: a positive, finite number of type ``kind`` (``nan``, ``inf``, ``0`` are refused)."""
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not (math.isfinite(value) and value > 0):
            what = tr("a positive integer", "正の整数") if kind is int else tr("a positive, finite number", "正の有限の数")
            raise argparse.ArgumentTypeError(tr(f"{text!r} is not {what}", f"{text!r} は{what}ではありません"))
        return value

    return parse


def _parser(one):
    """The options; ``one`` is the one-device run of the course profile, whose numbers the defaults follow."""
    ap = argparse.ArgumentParser(
        prog="python -m mparlib.train",
        description="Train the course's ResNet-18 on Fashion-MNIST on one or several GPUs "
                    "(chapter 05_multi_gpu_resnet) and write the live plot and the history. Defaults follow the "
                    f"course profile (now {course_profile()!r}; set MPARLIB_PROFILE=smoke|full to change it); on k "
                    "devices batch size and learning rate are k times those of one device.",
        epilog="d2l's two runs: `--gpus 1 --batch-size 256 --lr 0.1` and `--gpus 2 --batch-size 512 --lr 0.2`. "
               "Without --plot, the files go into a new folder runs/train-YYYYmmdd-HHMMSS/ of the current folder.")
    ap.add_argument("--gpus", type=_positive(int), default=None,
                    help="number of GPUs to use (error if fewer exist); default: all GPUs, or the CPU without one")
    ap.add_argument("--cpu", action="store_true", help="train on the CPU even if GPUs exist")
    ap.add_argument("--batch-size", type=_positive(int), default=None,
                    help=f"global batch size, split over the GPUs (default: {one['batch_size']} per device)")
    ap.add_argument("--lr", type=_positive(float), default=None,
                    help=f"SGD learning rate (default: {one['lr']} per device)")
    ap.add_argument("--epochs", type=_positive(int), default=None, dest="num_epochs",
                    help=f"number of epochs (default: {one['num_epochs']})")
    ap.add_argument("--width", type=_positive(int), default=None,
                    help=f"channels of the network's first stage; 64 is d2l's ResNet-18 (default: {one['width']})")
    ap.add_argument("--subset", type=_positive(int), nargs="*", default=None, metavar="N",
                    help="train on the first N images (and N//6 test images), or give N_TRAIN N_TEST; "
                         f"default: {one['subset'] or 'all 60,000 / 10,000'}")
    ap.add_argument("--data", default=None, help="folder holding the Fashion-MNIST files (default: searched)")
    ap.add_argument("--plot", default=None,
                    help=f"PNG file for the plot (default: {PLOT_NAME} in a new run folder under runs/)")
    ap.add_argument("--json", default=None,
                    help=f"JSON file for the history (default: {HISTORY_NAME} in the run folder, or none with --plot)")
    ap.add_argument("--overwrite", action="store_true", help="replace --plot/--json files that already exist")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the weights and the data order (default: 0)")
    ap.add_argument("--fast", action="store_true",
                    help="the fast path of 07_performance on one device (the first GPU, or the CPU): resident data, "
                         "channels_last, bf16 where native, fused SGD with momentum and a warm-up + cosine schedule, "
                         "torch.compile on GPUs")
    return ap


def _cli_devices(ap, args):
    """The devices of the command line, or a usage error saying which option to change."""
    if args.gpus is not None and args.cpu:
        ap.error(tr("use either --gpus N or --cpu", "--gpus N と --cpu のどちらか一方を指定してください"))
    if args.fast and (args.gpus or 1) > 1:
        ap.error(tr(f"--fast trains on one device; use --gpus 1 (or leave it out), not --gpus {args.gpus}",
                    f"--fast は 1つのデバイスで訓練します。--gpus {args.gpus} ではなく --gpus 1 にするか、省いてください"))
    have = num_gpus()
    if args.gpus is not None and args.gpus > have:
        fix = (tr(f"use --gpus {have} or fewer, or --cpu", f"--gpus {have} 以下にするか --cpu を指定してください") if have
               else tr("use --cpu, or leave --gpus out", "--cpu を指定するか --gpus を省いてください"))
        ap.error(tr(f"--gpus {args.gpus}: PyTorch sees {have} GPU(s) on this machine; {fix}",
                    f"--gpus {args.gpus}: このマシンで PyTorch から見える GPU は {have}枚です。{fix}"))
    devices = [torch.device("cpu")] if args.cpu else require_gpus(args.gpus) if args.gpus else try_all_gpus()
    return devices[:1] if args.fast else devices


def _check_outputs(ap, args):
    """Refuse --plot/--json files that would replace something (unless --overwrite) or collide."""
    paths = [(option, Path(p)) for option, p in (("--plot", args.plot), ("--json", args.json)) if p]
    if len(paths) == 2 and paths[0][1].resolve() == paths[1][1].resolve():
        ap.error(tr(f"--plot and --json name the same file {paths[0][1]}; give two file names",
                    f"--plot と --json が同じファイル {paths[0][1]} を指しています。別々のファイル名を指定してください"))
    for option, path in paths:
        if path.is_dir():
            ap.error(tr(f"{option} {path} is a folder; give a file name inside it",
                        f"{option} {path} はフォルダです。その中のファイル名を指定してください"))
        if path.exists() and not args.overwrite:
            ap.error(tr(f"{path} exists; choose another {option} file or pass --overwrite to replace it",
                        f"{path} はすでにあります。別の {option} ファイルを指定するか、置き換えるなら --overwrite を"
                        "付けてください"))


def _new_run_folder(base="runs"):
    """A new, empty folder ``runs/train-YYYYmmdd-HHMMSS`` (``-2``, ``-3``, ... when taken): never an old one.

    Returns the folder and the folders made for it (to remove again if the run writes nothing).
    """
    base = Path(base)
    made = [] if base.is_dir() else [base]
    if base.exists() and not base.is_dir():
        raise ConfigError(tr(f"{base} is a file, so no run folder can be made in it; pass --plot FILE (and --json "
                             "FILE) to say where the results go.",
                             f"{base} はファイルなので、その中に実行フォルダを作れません。--plot FILE（と --json FILE）"
                             "で結果の書き込み先を指定してください。"))
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for k in range(1, 10_000):
        folder = base / (f"train-{stamp}" if k == 1 else f"train-{stamp}-{k}")
        try:
            folder.mkdir()  # atomic: two runs never get the same folder
            return folder, [folder] + made
        except FileExistsError:
            continue
    raise ConfigError(f"{base}: no free run-folder name for {stamp}")


def _arguments(argv):
    """The parsed options, the devices, and every default filled in from :func:`experiment` on those devices."""
    ap = _parser(experiment(1))
    args = ap.parse_args(argv)
    devices = _cli_devices(ap, args)
    _check_outputs(ap, args)
    if args.subset is not None and len(args.subset) not in (1, 2):
        ap.error(tr("--subset takes N or N_TRAIN N_TEST", "--subset には N か N_TRAIN N_TEST を指定してください"))
    run = experiment(len(devices))
    args.subset = run["subset"] if args.subset is None else (args.subset[0] if len(args.subset) == 1 else
                                                             tuple(args.subset))
    for key in ("batch_size", "lr", "num_epochs", "width"):
        if getattr(args, key) is None:
            setattr(args, key, run[key])
    return args, devices


def _write_history(path, history):
    atomic_write_bytes(path, (json.dumps(history.to_dict(), indent=1) + "\n").encode())


def main(argv=None):
    """``python -m mparlib.train``: train ResNet-18, write its plot and history. Explained in 05_multi_gpu_resnet.

    Returns the exit code: 0 when done, 2 for a course error (printed as ``error: ...``), 130 when interrupted.
    Any other exception is a bug and shows its traceback.
    """
    try:
        course_profile()  # a bad MPARLIB_PROFILE is a course error, not a usage error
    except MparlibError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args, devices = _arguments(argv)
    plot, history_path, made = args.plot, args.json, []
    try:
        if plot is None:
            run, made = _new_run_folder()
            plot, history_path = run / PLOT_NAME, history_path or run / HISTORY_NAME
            print(tr(f"run folder: {run}", f"実行フォルダ: {run}"), flush=True)
        torch.manual_seed(args.seed)
        data = dict(subset=args.subset, root=args.data, shuffle_seed=args.seed)
        history = train(resnet18(10, width=args.width), devices, batch_size=args.batch_size, lr=args.lr,
                        num_epochs=args.num_epochs, data=data, animator=History.live_plot(args.num_epochs, path=plot),
                        progress=None, fast=args.fast or None)
    except (MparlibError, KeyboardInterrupt) as e:
        done = getattr(e, "history", None)  # a diverged run: the epochs finished before it
        if done is not None and done.epochs and history_path:
            _write_history(history_path, done)
        for folder in made:  # leave no empty run folder behind
            if not any(folder.iterdir()):
                folder.rmdir()
        if isinstance(e, KeyboardInterrupt):
            print(tr("Interrupted before the first epoch started.", "最初のエポックが始まる前に中断しました。"),
                  file=sys.stderr)
            return 130
        print(f"error: {e}", file=sys.stderr)
        return 2
    if history_path:
        _write_history(history_path, history)
    print(f"plot: {plot}" + (f", history: {history_path}" if history_path else ""))
    return 130 if history.interrupted else 0


if __name__ == "__main__":
    raise SystemExit(main())
