"""Data parallelism built from four primitives that run on any device, even one CPU listed k times.

``torch.nn.parallel`` has ``replicate``, ``scatter``, ``parallel_apply`` and ``gather``, but they accept only GPUs.
The versions here follow the same algebra on any list of devices, so ``["cpu"] * 4`` simulates four devices on a
laptop and every step of the data flow can be watched. Explained in 03_primitives.
"""
import dataclasses
import threading
import warnings
from contextlib import ExitStack

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .checks import is_int
from .devices import check_device, check_devices
from .errors import ConfigError, DeviceError
from .lang import tr

__all__ = ["replicate", "scatter", "scatter_kwargs", "parallel_apply", "gather", "data_parallel"]


# ---- Checks shared by the primitives ---------------------------------------------------------------------------
def _check_copyable(module, device):
    """Refuse lazy layers (no shape before one forward pass) and, PyTorch's rule, a module not on ``devices[0]``."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if is_lazy(t):
            raise ConfigError(tr(
                f"Cannot replicate {type(module).__name__}: '{name}' is an uninitialised lazy parameter (its shape "
                "is decided by the first forward pass). Run one dummy forward first, e.g. "
                "net(torch.zeros(1, *input_shape)) with the shape of one example, then replicate.",
                f"{type(module).__name__} を replicate できません。'{name}' はまだ初期化されていない遅延パラメータです"
                "（形は最初の順伝播で決まります）。先にダミーの順伝播を 1回実行してください。例えば 1つの例の形で "
                "net(torch.zeros(1, *input_shape)) を呼び、それから replicate します。"))
        if t.device != device:
            raise DeviceError(tr(
                f"module must have its parameters and buffers on device {device} (devices[0]) but found "
                f"'{name}' on device: {t.device}. Move it first: module.to('{device}').",
                f"モジュールのパラメータとバッファは devices[0] のデバイス {device} に置く必要がありますが、'{name}' "
                f"がデバイス {t.device} にあります。先に module.to('{device}') で移してください。"))


def _check_module(module, what):
    if not isinstance(module, nn.Module):
        raise ConfigError(tr(f"{what} copies an nn.Module, got {type(module).__name__}.",
                             f"{what} が複製するのは nn.Module です。渡されたのは {type(module).__name__} です。"))


def _check_dim(dim, what):
    if not is_int(dim):
        raise ConfigError(tr(f"{what}: dim={dim!r} must be an int, the dimension to split along (the batch is 0).",
                             f"{what}: dim={dim!r} には分割する次元を int で指定してください（バッチは 0 です）。"))


def _check_dim_fits(dim, t, what, where, where_ja):
    if not -t.dim() <= dim < t.dim():
        raise ConfigError(tr(f"{what} dim={dim} is out of range for {where} of shape {tuple(t.shape)}: use a "
                             f"dimension from {-t.dim()} to {t.dim() - 1} (the batch is usually 0).",
                             f"{what} の dim={dim} は、形 {tuple(t.shape)} の{where_ja}の範囲外です。{-t.dim()} から "
                             f"{t.dim() - 1} までの次元を指定してください（バッチはふつう 0 です）。"))


def _check_list(value, name, what, kind=(list, tuple)):
    """``value`` must be a list (one entry per replica) or, with ``kind=dict``, a dict of keyword arguments."""
    if not isinstance(value, kind) and not (kind is dict and value is None):
        en, ja = ("a dict of keyword arguments", "キーワード引数の dict") if kind is dict else \
            ("a list (one entry per replica)", "リスト（レプリカごとに 1つ）")
        raise ConfigError(tr(f"{what}: {name} must be {en}, got {type(value).__name__}.",
                             f"{what}: {name} には{ja}を渡してください。渡されたのは {type(value).__name__} です。"))


# ---- replicate -------------------------------------------------------------------------------------------------
def replicate(module, devices):
    """One copy of ``module`` per device; gradients of all copies flow back into the original. Explained in 03_primitives.

    A replica is a shallow copy of every submodule (its own tables of parameters, buffers and children, the same
    ``forward``). Its parameters are differentiable copies, ``p.to(device, copy=True)``, like PyTorch's
    ``Broadcast``: ``backward`` through several replicas adds each replica's gradient into the original
    ``p.grad``. Replica parameters are therefore not leaves; optimise the original module, never a replica.

    Buffers are copied, except that replica 0 shares the original's buffers, as in PyTorch's ``DataParallel``:
    in train mode BatchNorm's running statistics are updated from replica 0's chunk of the batch only, and the
    other replicas' updates are thrown away with the replicas. Plain Python attributes set in ``forward``
    (``self.counter += 1``) land on the replica and are lost too.

    The module must already live on ``devices[0]``. Unlike PyTorch, replica 0 gets copies of the parameters too
    (PyTorch's share storage with the original); values and gradients are the same, the memory is not.
    """
    return _replicate(module, check_devices(devices))


def _replicate(module, devices):
    """:func:`replicate` on a list that :func:`check_devices` accepted."""
    _check_module(module, "replicate")
    _check_copyable(module, devices[0])
    originals = list(module.modules())  # each submodule once, even if it is used twice
    replicas = []
    for j, device in enumerate(devices):
        # PyTorch's hook for a shallow copy (RNNs extend it); it leaves the parameter table empty.
        copy_of = {m: m._replicate_for_data_parallel() for m in originals}
        tensor_copy = {}  # a parameter shared by two layers gets one copy per replica, shared as well
        for m, r in copy_of.items():
            for name, child in m._modules.items():
                r._modules[name] = None if child is None else copy_of[child]
            for name, p in m._parameters.items():
                if p is not None and p not in tensor_copy:
                    tensor_copy[p] = p.to(device, copy=True)  # differentiable: ToCopyBackward
                r._parameters[name] = None if p is None else tensor_copy[p]
            for name, b in m._buffers.items():
                if b is None or (j == 0 and not b.requires_grad):
                    continue  # replica 0 keeps the original buffer object (already in its table)
                if b not in tensor_copy:
                    tensor_copy[b] = b.to(device, copy=True) if b.requires_grad else b.detach().to(device, copy=True)
                r._buffers[name] = tensor_copy[b]
        replicas.append(copy_of[module])
    return replicas


# ---- scatter ---------------------------------------------------------------------------------------------------
def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _is_dataclass_instance(obj):
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _init_fields(obj):
    """The names of a dataclass instance's ``__init__`` fields: what scatter and gather rebuild it from."""
    return [f.name for f in dataclasses.fields(obj) if f.init]


def _tensors_in(obj):
    """Every tensor that scatter would split, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _is_dataclass_instance(obj):
        for k in _init_fields(obj):
            yield from _tensors_in(getattr(obj, k))
    elif isinstance(obj, (dict, list, tuple)):
        for v in obj.values() if isinstance(obj, dict) else obj:
            yield from _tensors_in(v)


def scatter(inputs, devices, dim=0):
    """Split the tensors in ``inputs`` along ``dim``, one chunk per device, and move each chunk. Explained in 03_primitives.

    Chunks follow ``torch.chunk``: 5 rows over 2 devices give 3 and 2 rows; 2 rows over 3 devices give only 2
    chunks, so the list can be shorter than ``devices``. Tuples, lists, dicts, namedtuples and dataclasses are
    rebuilt around their chunks; anything else (numbers, strings, ``None``) is passed by reference to every chunk.
    Every tensor must have the same size along ``dim`` (it is the batch). The moves are differentiable.
    Returns a list with one object per used device.
    """
    return _scatter(inputs, check_devices(devices), dim)


def _scatter(inputs, devices, dim):
    """:func:`scatter` on a list that :func:`check_devices` accepted."""
    _check_dim(dim, "scatter")
    tensors = list(_tensors_in(inputs))
    for t in tensors:
        if t.dim() == 0:
            raise ConfigError(tr("scatter cannot split a 0-d tensor (a scalar); pass it as a Python number, which is "
                                 "copied to every device, or give it a batch dimension.",
                                 "scatter は 0次元のテンソル（スカラー）を分割できません。すべてのデバイスにコピー"
                                 "される Python の数値として渡すか、バッチの次元を付けてください。"))
        _check_dim_fits(dim, t, "scatter", "a tensor", "テンソル")
    sizes = {t.shape[dim] for t in tensors}
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ConfigError(tr(f"scatter splits every tensor along dim {dim}, the batch, so their sizes there must "
                             f"agree; got shapes {shapes}. Pass values that are not per-example as Python objects.",
                             f"scatter はすべてのテンソルをバッチの次元 {dim} で分割するので、その次元の大きさは"
                             f"そろっている必要があります。渡された形は {shapes} です。例ごとでない値は Python の"
                             "オブジェクトとして渡してください。"))
    n = len(tensors[0].chunk(len(devices), dim)) if tensors else len(devices)

    def split(obj):  # -> list of n objects
        if isinstance(obj, torch.Tensor):
            return [c.to(d) for c, d in zip(obj.chunk(len(devices), dim), devices)]
        if _is_namedtuple(obj):
            return [type(obj)(*parts) for parts in zip(*map(split, obj))] if obj else [obj] * n
        if isinstance(obj, (tuple, list)) and obj:
            return [type(obj)(parts) for parts in zip(*map(split, obj))]
        if isinstance(obj, dict) and obj:
            return [type(obj)(zip(obj.keys(), parts)) for parts in zip(*map(split, obj.values()))]
        if _is_dataclass_instance(obj) and _init_fields(obj):
            names = _init_fields(obj)
            return [dataclasses.replace(obj, **dict(zip(names, parts)))
                    for parts in zip(*(split(getattr(obj, k)) for k in names))]
        return [obj] * n

    return split(inputs)


def scatter_kwargs(inputs, kwargs, devices, dim=0):
    """Scatter positional and keyword arguments together: ``(args per device, kwargs per device)``. Explained in 03_primitives.

    Both are split in one pass, so the i-th positional chunk and the i-th keyword chunk always belong together.
    """
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    _check_list(kwargs, "kwargs", "scatter_kwargs", dict)
    pairs = _scatter((inputs, dict(kwargs or {})), check_devices(devices), dim)
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


# ---- parallel_apply --------------------------------------------------------------------------------------------
def _reraise(exc, where):
    """Raise ``exc`` again in this thread: same type, message says where, original traceback chained."""
    msg = tr(f"Caught {type(exc).__name__} in {where}: {exc}", f"{where} で {type(exc).__name__} が発生しました: {exc}")
    try:
        new = type(exc)(msg)
    except Exception:  # a class that refuses to be rebuilt from one message
        new = RuntimeError(msg)
    raise new from exc


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """Run ``modules[i](*inputs[i], **kwargs_tup[i])`` at the same time, one thread each. Explained in 03_primitives.

    An element of ``inputs`` is a tuple of positional arguments or a single object (one argument). Grad mode,
    inference mode and autocast are per thread in PyTorch, so the caller's settings are carried into each thread.
    If a replica raises, the same kind of exception is raised here, naming the replica and its device, with the
    replica's own traceback chained below it. Returns the outputs in order.
    """
    _check_list(modules, "modules", "parallel_apply")
    n = len(modules)
    for name, items in (("inputs", inputs), ("kwargs_tup", kwargs_tup), ("devices", devices)):
        if items is None and name != "inputs":
            continue
        _check_list(items, name, "parallel_apply")
        if len(items) != n:
            raise ConfigError(tr(
                f"parallel_apply got {n} modules but {len(items)} {name}; give one entry per module "
                "(data_parallel keeps only replicas[:len(inputs)]).",
                f"parallel_apply にモジュールが {n}個、{name} が {len(items)}個渡されました。モジュールごとに 1つずつ"
                "渡してください（data_parallel は replicas[:len(inputs)] だけを使います）。"))
    devices = [None] * n if devices is None else [check_device(d) if d is not None else None for d in devices]
    for i, d in enumerate(devices):
        if d is None:  # where does replica i run? where its input or its weights are
            t = next(_tensors_in(inputs[i]), None)
            if t is None and isinstance(modules[i], nn.Module):
                t = next(modules[i].parameters(), None)
            devices[i] = t.device if t is not None else torch.device("cpu")
    return _apply(modules, inputs, [{}] * n if kwargs_tup is None else list(kwargs_tup), devices)


def _apply(modules, inputs, kwargs_tup, devices):
    """:func:`parallel_apply` on lists of one entry per module, ``devices`` as checked ``torch.device`` objects."""
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = {kind: torch.get_autocast_dtype(kind) for kind in {"cpu", "cuda", *(d.type for d in devices)}
                if torch.is_autocast_enabled(kind)}
    cache = torch.is_autocast_cache_enabled()
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    results = [None] * len(modules)

    def work(i):
        args = inputs[i] if isinstance(inputs[i], (list, tuple)) else (inputs[i],)  # one tensor: one argument
        try:
            with ExitStack() as stack:
                if inference:
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(grad))
                for kind, dtype in autocast.items():
                    stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
                if devices[i].type == "cuda":
                    stack.enter_context(torch.cuda.device(devices[i]))
                    stack.enter_context(torch.cuda.stream(streams[i]))
                results[i] = ("ok", modules[i](*args, **kwargs_tup[i]))
        except BaseException as exc:  # noqa: B036 - handed to the caller, never swallowed
            results[i] = ("error", exc)

    if len(modules) == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"replica-{i}") for i in range(len(modules))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, (status, value) in enumerate(results):
        if status == "error":
            _reraise(value, tr(f"replica {i} on device {devices[i]}", f"デバイス {devices[i]} のレプリカ {i}"))
    return [value for _, value in results]


# ---- gather ----------------------------------------------------------------------------------------------------
def gather(outputs, target_device, dim=0):
    """Concatenate the replicas' outputs along ``dim`` on ``target_device``; differentiable. Explained in 03_primitives.

    Tuples, lists, dicts, namedtuples and dataclasses are gathered element by element. Scalars (0-d tensors, e.g.
    a per-replica loss) become a vector with one entry per replica, as in PyTorch. ``None`` stays ``None``; other
    values must be equal on every replica and are returned once.
    """
    return _gather(outputs, check_device(target_device, what="target_device"), dim)


def _gather(outputs, target, dim):
    """:func:`gather` to a checked ``torch.device``."""
    _check_dim(dim, "gather")
    _check_list(outputs, "outputs", "gather")
    if not outputs:
        raise ConfigError(tr("gather got no outputs; pass the list that parallel_apply returned.",
                             "gather に出力が 1つも渡されていません。parallel_apply が返したリストを渡してください。"))
    return _merge(list(outputs), "output", target, dim)


def _uneven(where, en, ja):
    """The replicas returned outputs that do not fit together."""
    return ConfigError(tr(f"gather: {where} {en}.", f"gather: {where} {ja}。"))


def _concatenate(items, where, target, dim):
    """One tensor per replica -> one tensor on ``target``, concatenated along ``dim``."""
    if not all(isinstance(x, torch.Tensor) for x in items):
        kinds = sorted({type(x).__name__ for x in items})
        raise _uneven(where, f"is a tensor on some replicas and not on others: {kinds}",
                      f"がテンソルのレプリカとそうでないレプリカがあります: {kinds}")
    if all(t.dim() == 0 for t in items) and dim == 0:
        warnings.warn(tr("gather: all replicas returned scalars; returning a vector with one entry per replica.",
                         "gather: すべてのレプリカがスカラーを返したので、レプリカごとに 1つの要素を持つベクトルを"
                         "返します。"), stacklevel=5)
        items = [t.reshape(1) for t in items]
    for t in items:
        _check_dim_fits(dim, t, "gather", where, f" {where} ")
    if len({t.shape[:dim % t.dim()] + t.shape[dim % t.dim() + 1:] for t in items}) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in items)
        raise ConfigError(tr(f"gather concatenates along dim {dim}, so {where} must have the same shape in every "
                             f"other dimension on every replica; got {shapes}.",
                             f"gather は次元 {dim} に沿って連結するので、{where} のほかの次元の大きさはすべての"
                             f"レプリカでそろっている必要があります。渡された形は {shapes} です。"))
    return torch.cat([t.to(target) for t in items], dim)


def _merge(items, where, target, dim):
    """The replicas' values at one place (``where``) of the output, merged into one."""
    first, kinds = items[0], sorted({type(x).__name__ for x in items})
    if isinstance(first, torch.Tensor):
        return _concatenate(items, where, target, dim)
    if first is None:
        if any(x is not None for x in items):
            raise _uneven(where, "is None on some replicas and not on others",
                          "が None のレプリカとそうでないレプリカがあります")
        return None
    if len(kinds) > 1:
        raise _uneven(where, f"has different types on different replicas: {kinds}",
                      f"の型がレプリカによって違います: {kinds}")
    if isinstance(first, dict):
        if any(x.keys() != first.keys() for x in items):
            keys = [sorted(map(str, x)) for x in items]
            raise _uneven(where, f"is a dict with different keys on different replicas: {keys}",
                          f"は辞書ですが、キーがレプリカによって違います: {keys}")
        return type(first)((k, _merge([x[k] for x in items], f"{where}[{k!r}]", target, dim)) for k in first)
    if isinstance(first, (tuple, list)):
        if len({len(x) for x in items}) > 1:
            raise _uneven(where, "has different lengths on different replicas", "の長さがレプリカによって違います")
        parts = [_merge(list(col), f"{where}[{i}]", target, dim) for i, col in enumerate(zip(*items))]
        return type(first)(*parts) if _is_namedtuple(first) else type(first)(parts)
    if _is_dataclass_instance(first):
        return dataclasses.replace(first, **{k: _merge([getattr(x, k) for x in items], f"{where}.{k}", target, dim)
                                             for k in _init_fields(first)})
    if all(x == first for x in items[1:]):
        return first
    raise ConfigError(tr(f"gather cannot combine {where} = {items!r}: only tensors are concatenated; other values "
                         "must be equal on every replica. Return a tensor instead.",
                         f"gather は {where} = {items!r} をまとめられません。連結できるのはテンソルだけで、ほかの値は"
                         "すべてのレプリカで等しい必要があります。テンソルを返してください。"))


# ---- data_parallel ---------------------------------------------------------------------------------------------
def data_parallel(module, inputs, device_ids, output_device=None, dim=0, module_kwargs=None):
    """``module(*inputs)`` computed by replicas on ``device_ids``, composed from the four primitives. Explained in 03_primitives.

    ``inputs`` is one argument or a tuple of positional arguments. With empty ``device_ids`` the module is simply
    called. The result lands on ``output_device`` (default ``device_ids[0]``). The device list is checked once
    here; the four steps then run on the checked list.
    """
    if device_ids is None:
        raise ConfigError(tr("data_parallel: device_ids=None; pass a list of devices (mparlib.try_all_gpus(), or "
                             "['cpu'] * k to simulate k devices), or [] to call the module directly.",
                             "data_parallel: device_ids=None は使えません。デバイスのリスト（mparlib.try_all_gpus() "
                             "や、k 個のデバイスを模擬する ['cpu'] * k）か、モジュールを直接呼ぶための [] を渡してください。"))
    _check_list(module_kwargs, "module_kwargs", "data_parallel", dict)
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    module_kwargs = dict(module_kwargs or {})
    if isinstance(device_ids, (list, tuple)) and not device_ids:
        return module(*inputs, **module_kwargs)
    devices = check_devices(device_ids, what="device_ids")
    output_device = devices[0] if output_device is None else check_device(output_device, what="output_device")

    replicas = _replicate(module, devices)
    # one (args, kwargs) pair per used device; nothing to split: run one replica
    pairs = _scatter((inputs, module_kwargs), devices, dim) if inputs or module_kwargs else [((), {})]
    n = len(pairs)  # a batch smaller than the device count uses fewer replicas
    outputs = _apply(replicas[:n], [p[0] for p in pairs], [p[1] for p in pairs], devices[:n])
    return _gather(outputs, output_device, dim)
