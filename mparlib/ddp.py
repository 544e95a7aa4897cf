"""``python -m mparlib.ddp``: the DDP experiment of :mod:`mparlib.ddp_train` from a terminal. Explained in 06_ddp.

``torchrun --nproc_per_node=2 -m mparlib.ddp`` (torchrun starts the processes) or ``python -m mparlib.ddp --nproc 2``
(this module starts them with :func:`mparlib.launch.launch`). The defaults are chapter 5's experiment
(``DDPConfig.for_profile("full", world)``). Course errors end with ``error: ...`` and exit code 2 (1 for a failed
rank, 130 when interrupted); the process is left as it was (signal handlers, environment).
"""
import argparse
import dataclasses
import os
import signal
import sys
import threading
from pathlib import Path

from .checks import positive_int
from .ddp_train import DDPConfig, check_run, train_worker
from .errors import LaunchError, MparlibError, WorkerFailed
from .lang import tr
from .launch import launch
from .rendezvous import RENDEZVOUS_VARS, choose_backend, process_group, rendezvous_env
from .runfolder import lock_folder, read_checkpoint


def _pair(text, crash=False):
    """An argparse type: ``--subset N[,N_TEST]`` (N_TEST is N // 6 when left out) or ``--crash-at EPOCH:STEP``."""
    try:
        parts = [int(p) for p in text.replace(":", ",").split(",")]
    except ValueError:
        parts = []
    if len(parts) == 1 and not crash:
        parts.append(max(1, parts[0] // 6))
    if len(parts) != 2 or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use " + ("EPOCH:STEP, e.g. 2:1" if crash else
                                                             "N (N training and N//6 test examples) or N_TRAIN,N_TEST"))
    return tuple(parts)


def _parser():
    """The options; ``--batch-size`` and ``--lr`` default to None, which means the profile's value times the world."""
    d = DDPConfig()
    ap = argparse.ArgumentParser(
        prog="python -m mparlib.ddp",
        description="Train the chapter-5 ResNet-18 on Fashion-MNIST with DistributedDataParallel.",
        epilog="Start it with `torchrun --nproc_per_node=N -m mparlib.ddp [options]` or with "
               "`python -m mparlib.ddp --nproc N [options]`.")
    ap.add_argument("--nproc", type=int, help="start N local processes (not under torchrun)")
    ap.add_argument("--port", type=int, help="rendezvous port for --nproc (default: $MASTER_PORT, else a free one)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--model", default=d.model, choices=["resnet18", "mlp"])
    ap.add_argument("--width", type=int, default=d.width,
                    help="channels of the ResNet-18's stem (default: %(default)s, d2l's network; 16 runs ~10x faster)")
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--batch-size", type=int, default=None,
                    help=f"global batch, split across processes (default: {d.batch_size} per process)")
    ap.add_argument("--lr", type=float, default=None, help=f"learning rate (default: {d.lr} per process)")
    ap.add_argument("--momentum", type=float, default=d.momentum)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--subset", type=_pair, default=None, metavar="N[,N_TEST]",
                    help="use the first N training (and N_TEST test) examples")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--sync-bn", action="store_true", help="convert BatchNorm to SyncBatchNorm (GPUs only)")
    ap.add_argument("--out", default=d.out, help="folder for checkpoint.pt and plot.png (default: %(default)s)")
    ap.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    ap.add_argument("--data-root", default=None, help="folder holding the Fashion-MNIST files")
    ap.add_argument("--crash-at", type=lambda text: _pair(text, crash=True), default=None, metavar="EPOCH:STEP",
                    help="rank 0 kills itself at that step (to try --resume)")
    ap.add_argument("--no-plot", dest="plot", action="store_false")
    return ap


def main(argv=None):
    """Entry point of ``python -m mparlib.ddp`` and ``torchrun -m mparlib.ddp``; returns the exit code. Explained in 06_ddp."""
    args = _parser().parse_args(argv)
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(DDPConfig)
             if getattr(args, f.name, None) is not None}  # None: the profile's value (batch size, lr) or the default
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ or all(os.environ.get(k) for k in RENDEZVOUS_VARS)
    try:
        if under_torchrun and args.nproc is not None:
            raise LaunchError(tr("--nproc starts processes, but this one was already started by torchrun: drop "
                                 "--nproc and use torchrun's --nproc_per_node.",
                                 "--nproc はプロセスを起動するオプションですが、このプロセスはすでに torchrun が起動"
                                 "しています。--nproc を外し、torchrun の --nproc_per_node を使ってください。"))
        # without torchrun's variables and without --nproc, rendezvous_env raises the error that explains how to start
        nproc = rendezvous_env()["world_size"] if args.nproc is None else positive_int(args.nproc, "--nproc", 2)
        cfg = DDPConfig.for_profile("full", nproc, **given)
        if under_torchrun:
            with process_group(args.backend):
                train_worker(cfg)
            return 0
        check_run(cfg, nproc, choose_backend(args.backend, nproc))
        port = args.port if args.port is not None else int(os.environ.get("MASTER_PORT", 0) or 0)
        main_thread = threading.current_thread() is threading.main_thread()  # only it may set signal handlers
        before = signal.signal(signal.SIGTERM, signal.default_int_handler) if main_thread else None  # as Ctrl+C
        try:
            with lock_folder(cfg.out, what="--out"):  # held for the whole run; the ranks are told so in their config
                read_checkpoint(cfg)  # refuse now, not after starting the processes
                launch(train_worker, nproc, args=(dataclasses.replace(cfg, out_locked=True),), backend=args.backend,
                       port=port, log_dir=Path(cfg.out) / "logs")
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, before)
        return 0
    except MparlibError as e:
        if int(os.environ.get("LOCAL_RANK", "0") or 0) == 0:  # one message per machine
            print(f"error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, WorkerFailed) else 2
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(tr(f"interrupted; the checkpoint of the last finished epoch stays in {args.out}: continue with "
                     "--resume", f"中断しました。最後に終わったエポックのチェックポイントは {args.out} に残っています。"
                     "--resume で続けられます"), file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # under torchrun: skip the interpreter's teardown, where gloo's C++ threads may abort the process
