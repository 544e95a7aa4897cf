"""How cooperating processes find each other: the backend, the rendezvous variables and the process group.

``torchrun`` starts one process per device and sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in
each; :func:`process_group` joins such processes into a group (nccl on GPUs, gloo on CPUs) and always leaves it.
:mod:`mparlib.launch` starts the processes from Python or a notebook. Explained in 06_ddp.
"""
import contextlib
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from .checks import int_in, one_of, seconds
from .devices import num_gpus
from .errors import ConfigError, LaunchError
from .lang import tr

RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def choose_backend(backend="auto", nproc=1):
    """The backend for ``nproc`` processes on this machine: ``"nccl"`` or ``"gloo"``. Explained in 06_ddp.

    ``"auto"`` takes nccl when the machine has a GPU for each of the ``nproc`` processes, and gloo (processes on the
    CPU) otherwise. An explicit choice is checked: nccl needs one GPU per process.
    """
    if one_of(backend, "backend", ("auto", "gloo", "nccl")) == "auto":
        return "nccl" if dist.is_nccl_available() and num_gpus() >= nproc else "gloo"
    check_gpus(backend, nproc)
    return backend


def describe(nproc, backend="auto"):
    """One sentence saying how ``nproc`` processes would run here, and why. Explained in 08_collectives."""
    chosen, gpus = choose_backend(backend, nproc), num_gpus()
    procs = f"{nproc} process" + ("es" if nproc != 1 else "")
    if chosen == "nccl":
        return tr(f"{procs}, one per GPU, with nccl.", f"GPU 1枚につき 1個、計 {nproc}個のプロセスを nccl で動かします。")
    why = tr("this machine has no GPU", "このマシンには GPU がありません") if gpus == 0 else \
        tr("gloo was asked for", "gloo が指定されました") if backend == "gloo" else \
        tr(f"nccl needs one GPU per process and this machine has {gpus}",
           f"nccl には 1個のプロセスに GPU が 1枚必要ですが、このマシンの GPU は {gpus}枚です")
    return tr(f"{procs} on the CPU with gloo ({why}).", f"{nproc}個のプロセスを CPU 上で gloo を使って動かします（{why}）。")


def check_gpus(backend, nproc):
    """With nccl every process of this machine needs its own GPU: raise if ``nproc`` exceeds them. Explained in 06_ddp."""
    n = num_gpus()
    if backend != "nccl" or nproc <= n:
        return
    if n == 0:
        raise LaunchError(tr("The nccl backend needs CUDA GPUs and PyTorch sees none on this machine: use backend "
                             "'gloo' (or 'auto', which picks gloo here).",
                             "nccl バックエンドには CUDA の GPU が必要ですが、このマシンでは PyTorch から GPU が見えません。"
                             "バックエンドに 'gloo'（または、ここでは gloo を選ぶ 'auto'）を指定してください。"))
    raise LaunchError(tr(f"{nproc} processes were asked for on this machine, but it has {n} GPU(s) and the nccl backend "
                         f"needs one GPU per process. Use at most {n} processes (--nproc {n} or torchrun "
                         f"--nproc_per_node={n}), or the gloo backend to run the processes on the CPU.",
                         f"このマシンで {nproc}個のプロセスが指定されましたが、GPU は {n}枚しかありません。nccl バックエンド"
                         f"では 1個のプロセスに GPU が 1枚必要です。プロセスを {n}個以下にする（--nproc {n} または "
                         f"torchrun --nproc_per_node={n}）か、gloo バックエンドで CPU 上のプロセスとして動かしてください。"))


def free_port(host="127.0.0.1"):
    """A TCP port that is free right now, found by letting the system choose one (bind to port 0). Explained in 06_ddp."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(port, host="127.0.0.1"):
    """Raise a clear error if a rendezvous server could not listen on ``host:port`` (bind test). Explained in 06_ddp."""
    int_in(port, "MASTER_PORT", 1, 65535, 29500)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is usable; a listening one is not
        try:
            s.bind((host, port))
        except OSError as e:
            other = free_port(host)
            raise LaunchError(tr(
                f"Port {port} on {host} is already in use ({e.strerror}): another training run or program listens "
                f"there, and the rendezvous server must open on it. Pick another port, e.g. --port {other} (free right "
                f"now; MASTER_PORT={other} in the environment works too), or --port 0 to let the system choose a free "
                "one. `ss -ltnp` shows which program holds a port.",
                f"{host} のポート {port} はすでに使われています（{e.strerror}）。別の訓練やプログラムがそこで待ち受けて"
                f"いますが、ランデブーのサーバーはこのポートで開く必要があります。別のポートを選んでください。例えば "
                f"--port {other}（今は空いています。環境変数 MASTER_PORT={other} でも指定できます）、または --port 0 で"
                "空いているポートをシステムに選ばせます。どのプログラムがポートを使っているかは `ss -ltnp` でわかります。"
            )) from None


def listening_store(host, port, world_size, timeout=120):
    """A rendezvous server (``TCPStore``) that listens on ``host`` alone, not on every interface. Explained in 12_planning.

    ``TCPStore(is_master=True)`` by itself listens on every interface of the machine, so any computer that can reach
    it could read and write the keys the ranks meet by. Here the socket is bound to ``host`` (``127.0.0.1`` for one
    machine; the address of the interface the other machines reach for a run over several) and listening before the
    store takes it over (``master_listen_fd``). ``port=0`` lets the system choose; ``store.port`` says which.
    """
    int_in(port, "port", 0, 65535, 29500)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
        chosen = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # from here on the store owns the socket and closes it
    options = dict(is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout), master_listen_fd=fd)
    try:
        return dist.TCPStore(host, chosen, world_size, use_libuv=True, **options)
    except NotImplementedError:  # older torch (2.7, checked): only the legacy backend takes over a listening socket
        return dist.TCPStore(host, chosen, world_size, use_libuv=False, **options)


def interface_of(host):
    """The name of the network interface that holds the address ``host`` (``"lo"`` for 127.0.0.1), or None. Explained in 12_planning.

    gloo opens connections of its own between the ranks; ``GLOO_SOCKET_IFNAME`` set to this name keeps them on the
    interface the rendezvous uses instead of the one the machine's host name resolves to.
    """
    import psutil

    try:
        wanted = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] in wanted for a in addresses):
            return name
    return None


def _own_store(info):
    """The store for processes started by hand (no torchrun agent): rank 0 serves it on ``MASTER_ADDR`` only."""
    host, port, world = info["master_addr"], info["master_port"], info["world_size"]
    interface = interface_of(host)  # None on a machine that does not hold MASTER_ADDR (another node's rank)
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:  # gloo's own connections stay on that interface too
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    if info["rank"] != 0:
        return dist.TCPStore(host, port, world, is_master=False, timeout=timedelta(seconds=120))
    try:
        return listening_store(host, port, world)
    except OSError as e:
        raise LaunchError(tr(
            f"Rank 0 cannot serve the rendezvous on MASTER_ADDR={host}, MASTER_PORT={port} ({e.strerror or e}). "
            "MASTER_ADDR must be an address of rank 0's own machine (127.0.0.1 for one machine, or the interface "
            "the other machines reach), and the port must be free.",
            f"ランク 0 は MASTER_ADDR={host}、MASTER_PORT={port} でランデブーのサーバーを開けません（{e.strerror or e}）。"
            "MASTER_ADDR はランク 0 自身のマシンのアドレス（1台なら 127.0.0.1、複数台なら他のマシンから届く"
            "インターフェースのアドレス）で、ポートは空いていなければなりません。")) from None


def rendezvous_env(environ=None):
    """Read the variables torchrun sets for each process (rank, world size, master address and port). Explained in 06_ddp.

    Without them a process cannot know who it is or where to meet the others, so this raises an error that says
    how to start the program instead.
    """
    env = os.environ if environ is None else environ
    missing = [k for k in RENDEZVOUS_VARS if not env.get(k)]
    if missing:
        raise LaunchError(tr(
            f"The rendezvous variables {', '.join(missing)} are not set, so this process does not know its rank or "
            "where to meet the others. Start it with torchrun, which sets them for every process:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "or let mparlib start the processes itself:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      (from Python: mparlib.launch.launch(fn, 2))",
            f"ランデブーの環境変数 {', '.join(missing)} が設定されていないため、このプロセスは自分のランクも、"
            "他のプロセスと落ち合う場所もわかりません。各プロセスに変数を設定する torchrun で起動してください:\n"
            "    torchrun --nproc_per_node=2 -m mparlib.ddp [options]\n"
            "または mparlib 自身にプロセスを起動させます:\n"
            "    python -m mparlib.ddp --nproc 2 [options]      （Python からは mparlib.launch.launch(fn, 2)）"))
    try:
        info = {k.lower(): int(env[k]) for k in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        info["local_rank"] = int(env.get("LOCAL_RANK", info["rank"]))
        info["local_world_size"] = int(env.get("LOCAL_WORLD_SIZE", info["world_size"]))
    except ValueError as e:
        raise ConfigError(tr(f"A rendezvous variable is not an integer ({e}); RANK, LOCAL_RANK, WORLD_SIZE and "
                             "MASTER_PORT must be numbers.",
                             f"ランデブーの環境変数に整数でない値があります（{e}）。RANK、LOCAL_RANK、WORLD_SIZE、"
                             "MASTER_PORT は数でなければなりません。")) from None
    info["master_addr"] = env["MASTER_ADDR"]
    int_in(info["rank"], "RANK", 0, info["world_size"] - 1, where=f"WORLD_SIZE={info['world_size']}")
    return info


@contextlib.contextmanager
def process_group(backend="auto", timeout=None, store=None):
    """Join the process group described by the rendezvous variables; always leave it on exit. Explained in 06_ddp.

    Yields a dict ``rank, world_size, local_rank, local_world_size, backend, device``. Processes started by hand
    (variables set without torchrun) meet at a store that rank 0 serves on ``MASTER_ADDR`` only
    (:func:`listening_store`). ``timeout`` (seconds) bounds
    how long a collective waits for the other ranks (PyTorch's default is 30 minutes). ``destroy_process_group`` runs
    on success and on error, so a failing rank does not leave its communicator behind.
    """
    info = rendezvous_env()
    info["backend"] = backend = choose_backend(backend, info["local_world_size"])  # nccl: one GPU per process
    info["device"] = torch.device("cuda", info["local_rank"]) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(info["device"])
    timeout = seconds(timeout, "timeout", "process_group")
    if store is None and "TORCHELASTIC_RUN_ID" not in os.environ:  # started by hand: torch's own store would listen
        store = _own_store(info)  # on every interface; under torchrun its agent serves the store
    dist.init_process_group(backend, rank=info["rank"], world_size=info["world_size"], store=store,
                            timeout=None if timeout is None else timedelta(seconds=timeout))
    try:
        yield info
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def device():
    """This rank's device: ``cuda:LOCAL_RANK`` in an nccl group, the CPU in a gloo group. Explained in 08_collectives."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
