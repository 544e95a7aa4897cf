"""Data parallelism built from four primitives that run on any device, even one CPU listed k times.

``torch.nn.parallel`` has ``replicate``, ``scatter``, ``parallel_apply`` and ``gather``, but they accept only GPUs.
The versions here follow the same algebra on any list of devices, so ``["cpu"] * 4`` simulates four devices on a
laptop and every step of the data flow can be watched. Explained in 03_primitives; the attribute-forwarding wrapper
and the checkpoint helpers are explained in 02_wrapped_attributes.
"""
import dataclasses
import sys
import threading
import warnings
import zipfile
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present
from torch.nn.parameter import is_lazy

from .files import atomic_torch_save

__all__ = [
    "replicate", "scatter", "scatter_kwargs", "parallel_apply", "gather", "data_parallel",
    "AttrDataParallel", "unwrap", "state_dict_of", "save_checkpoint", "load_checkpoint", "CheckpointMismatchError",
]

CHECKPOINT_FORMAT = "mparlib-checkpoint/1"


# ----------------------------------------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------------------------------------
def _parse(d, what="device"):
    """One device as ``torch.device``: ints are GPU numbers (as in ``torch.nn.parallel``), ``-1`` is the CPU."""
    if isinstance(d, int) and not isinstance(d, bool):
        return torch.device("cpu") if d == -1 else torch.device("cuda", d)
    try:
        return torch.device(d)
    except (RuntimeError, TypeError):
        raise ValueError(f"{what} {d!r} is not a device; use e.g. 'cpu', 'cuda:0' or 0.") from None


def _device(d, what="device"):
    """One device, checked to exist on this machine (``cuda:7`` on a 1-GPU machine is an error)."""
    d = _parse(d, what)
    if d.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = d.index if d.index is not None else (torch.cuda.current_device() if have else 0)
        if index >= have:
            gpus = "no CUDA GPU" if have == 0 else (
                f"{have} CUDA GPU{'s' if have > 1 else ''} ({', '.join(f'cuda:{i}' for i in range(have))})")
            raise ValueError(
                f"{what} cuda:{index} does not exist: this machine has {gpus}. Use the devices from "
                f"mparlib.try_all_gpus(), or ['cpu'] * k to simulate k devices on the CPU.")
        d = torch.device("cuda", index)
    return d


def _devices(devices, what="devices"):
    """A list of devices, checked: all of one kind (GPUs, or the CPU listed k times), and all exist."""
    if isinstance(devices, (str, int, torch.device)):
        raise TypeError(f"{what} must be a list of devices such as ['cuda:0', 'cuda:1'] or ['cpu'] * 2, "
                        f"not the single device {devices!r}.")
    parsed = [_parse(d, what) for d in devices]
    if len({d.type for d in parsed}) > 1:
        # With the CPU among GPUs, PyTorch's own words come first, then what to do about it.
        cpu = next((d for d in parsed if d.type == "cpu"), None)
        pytorch_says = f"Expected a non cpu device, but got: {cpu}. " if cpu is not None else ""
        shown = ", ".join(str(d) for d in parsed)
        raise ValueError(
            f"{pytorch_says}The list [{shown}] mixes kinds of device; data "
            f"parallelism needs one kind: all GPUs (mparlib.try_all_gpus()) or the CPU listed k times "
            f"(['cpu'] * k) to simulate k devices.")
    return [_device(d) for d in parsed]


def _check_initialised(module, action="replicate"):
    """Lazy layers (``nn.LazyLinear`` ...) have no shape until one forward pass: refuse to copy them."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if is_lazy(t):
            raise RuntimeError(
                f"Cannot {action} {type(module).__name__}: '{name}' is an uninitialised lazy parameter (its shape "
                f"is decided by the first forward pass). Run one dummy forward first, e.g. "
                f"net(torch.zeros(1, *input_shape)) with the shape of one example, then {action}.")


def _check_on(module, device):
    """PyTorch's rule: the module to copy lives on ``devices[0]``; say where it is instead."""
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device != device:
            raise RuntimeError(
                f"module must have its parameters and buffers on device {device} (devices[0]) but found "
                f"'{name}' on device: {t.device}. Move it first: module.to('{device}').")


def _first_tensor(obj):
    """The first tensor inside a nest of tuples, lists and dicts, or None."""
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    for item in items:
        t = _first_tensor(item)
        if t is not None:
            return t
    return None


# ----------------------------------------------------------------------------------------------------------------
# replicate
# ----------------------------------------------------------------------------------------------------------------
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
    devices = _devices(devices)
    if not devices:
        return []
    _check_initialised(module)
    _check_on(module, devices[0])
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


# ----------------------------------------------------------------------------------------------------------------
# scatter
# ----------------------------------------------------------------------------------------------------------------
def _is_namedtuple(obj):
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and hasattr(obj, "_asdict")


def _is_dataclass_instance(obj):
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def _tensors_in(obj):
    """Every tensor that scatter would split, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif _is_dataclass_instance(obj):
        for f in dataclasses.fields(obj):
            if f.init:
                yield from _tensors_in(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors_in(v)


def scatter(inputs, devices, dim=0):
    """Split the tensors in ``inputs`` along ``dim``, one chunk per device, and move each chunk. Explained in 03_primitives.

    Chunks follow ``torch.chunk``: 5 rows over 2 devices give 3 and 2 rows; 2 rows over 3 devices give only 2
    chunks, so the list can be shorter than ``devices``. Tuples, lists, dicts, namedtuples and dataclasses are
    rebuilt around their chunks; anything else (numbers, strings, ``None``) is passed by reference to every chunk.
    Every tensor must have the same size along ``dim`` (it is the batch). The moves are differentiable.
    Returns a list with one object per used device.
    """
    devices = _devices(devices)
    if not devices:
        raise ValueError("scatter needs at least one device, e.g. ['cpu'] or ['cuda:0', 'cuda:1'].")
    tensors = list(_tensors_in(inputs))
    for t in tensors:
        if t.dim() == 0:
            raise ValueError("scatter cannot split a 0-d tensor (a scalar); pass it as a Python number, which is "
                             "copied to every device, or give it a batch dimension.")
        if not -t.dim() <= dim < t.dim():
            raise IndexError(f"scatter dim={dim} is out of range for a tensor of shape {tuple(t.shape)}: "
                             f"use a dimension from {-t.dim()} to {t.dim() - 1} (the batch is usually 0).")
    sizes = {t.shape[dim] for t in tensors}
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(f"scatter splits every tensor along dim {dim}, the batch, so their sizes there must agree; "
                         f"got shapes {shapes}. Pass values that are not per-example as Python objects.")
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
        if _is_dataclass_instance(obj) and any(f.init for f in dataclasses.fields(obj)):
            names = [f.name for f in dataclasses.fields(obj) if f.init]
            return [dataclasses.replace(obj, **dict(zip(names, parts)))
                    for parts in zip(*(split(getattr(obj, k)) for k in names))]
        return [obj] * n

    return split(inputs)


def scatter_kwargs(inputs, kwargs, devices, dim=0):
    """Scatter positional and keyword arguments together: ``(args per device, kwargs per device)``. Explained in 03_primitives.

    Both are split in one pass, so the i-th positional chunk and the i-th keyword chunk always belong together.
    """
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    pairs = scatter((inputs, dict(kwargs or {})), devices, dim)
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)


# ----------------------------------------------------------------------------------------------------------------
# parallel_apply
# ----------------------------------------------------------------------------------------------------------------
def _reraise(exc, where):
    """Raise ``exc`` again in this thread: same type, message says where, original traceback chained."""
    msg = f"Caught {type(exc).__name__} in {where}: {exc}"
    try:
        new = type(exc)(msg)
    except Exception:
        new = RuntimeError(msg)
    if not isinstance(new, type(exc)):  # a class that refuses to be rebuilt this way
        new = RuntimeError(msg)
    raise new from exc


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """Run ``modules[i](*inputs[i], **kwargs_tup[i])`` at the same time, one thread each. Explained in 03_primitives.

    An element of ``inputs`` is a tuple of positional arguments or a single object (one argument). Grad mode,
    inference mode and autocast are per thread in PyTorch, so the caller's settings are carried into each thread.
    If a replica raises, the same kind of exception is raised here, naming the replica and its device, with the
    replica's own traceback chained below it. Returns the outputs in order.
    """
    n = len(modules)
    if len(inputs) != n:
        raise ValueError(f"parallel_apply got {n} modules but {len(inputs)} inputs; give one input per module "
                         f"(data_parallel keeps only replicas[:len(inputs)]).")
    kwargs_tup = [{}] * n if kwargs_tup is None else list(kwargs_tup)
    if len(kwargs_tup) != n:
        raise ValueError(f"parallel_apply got {n} modules but {len(kwargs_tup)} keyword dicts.")
    if devices is None:
        devices = [None] * n
    elif len(devices) != n:
        raise ValueError(f"parallel_apply got {n} modules but {len(devices)} devices.")
    devices = [_device(d) if d is not None else None for d in devices]
    for i, d in enumerate(devices):
        if d is None:  # where does replica i run? where its input or its weights are
            t = _first_tensor(inputs[i])
            t = next(modules[i].parameters(), None) if t is None else t
            devices[i] = t.device if t is not None else torch.device("cpu")

    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    autocast = {kind: torch.get_autocast_dtype(kind) for kind in {"cpu", "cuda", *(d.type for d in devices)}
                if torch.is_autocast_enabled(kind)}
    cache = torch.is_autocast_cache_enabled()
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    results = [None] * n

    def work(i):
        module, args, kwargs, device = modules[i], inputs[i], kwargs_tup[i], devices[i]
        if not isinstance(args, (list, tuple)):
            args = (args,)  # a single tensor is one argument, not a sequence of rows
        try:
            with ExitStack() as stack:
                if inference:
                    stack.enter_context(torch.inference_mode())
                stack.enter_context(torch.set_grad_enabled(grad))
                for kind, dtype in autocast.items():
                    stack.enter_context(torch.autocast(kind, dtype=dtype, cache_enabled=cache))
                if device.type == "cuda":
                    stack.enter_context(torch.cuda.device(device))
                    stack.enter_context(torch.cuda.stream(streams[i]))
                results[i] = ("ok", module(*args, **kwargs))
        except BaseException as exc:  # noqa: B036 - handed to the caller, never swallowed
            results[i] = ("error", exc)

    if n == 1:
        work(0)
    else:
        threads = [threading.Thread(target=work, args=(i,), name=f"replica-{i}") for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, (status, value) in enumerate(results):
        if status == "error":
            _reraise(value, f"replica {i} on device {devices[i]}")
    return [value for _, value in results]


# ----------------------------------------------------------------------------------------------------------------
# gather
# ----------------------------------------------------------------------------------------------------------------
def gather(outputs, target_device, dim=0):
    """Concatenate the replicas' outputs along ``dim`` on ``target_device``; differentiable. Explained in 03_primitives.

    Tuples, lists, dicts, namedtuples and dataclasses are gathered element by element. Scalars (0-d tensors, e.g.
    a per-replica loss) become a vector with one entry per replica, as in PyTorch. ``None`` stays ``None``; other
    values must be equal on every replica and are returned once.
    """
    target = _device(target_device, what="target_device")
    if not outputs:
        raise ValueError("gather got no outputs; pass the list that parallel_apply returned.")

    def merge(items, where):
        first = items[0]
        kinds = {type(x) for x in items}
        if isinstance(first, torch.Tensor):
            if not all(isinstance(x, torch.Tensor) for x in items):
                raise TypeError(f"gather: {where} is a tensor on some replicas and not on others: {sorted(map(str, kinds))}")
            if all(t.dim() == 0 for t in items) and dim == 0:
                warnings.warn("gather: all replicas returned scalars; returning a vector with one entry per replica.",
                              stacklevel=3)
                items = [t.reshape(1) for t in items]
            for t in items:
                if not -t.dim() <= dim < t.dim():
                    raise IndexError(f"gather dim={dim} is out of range for {where} of shape {tuple(t.shape)}: "
                                     f"use a dimension from {-t.dim()} to {t.dim() - 1}.")
            rest = {t.shape[:dim % t.dim()] + t.shape[dim % t.dim() + 1:] for t in items}
            if len(rest) > 1:
                shapes = ", ".join(str(tuple(t.shape)) for t in items)
                raise ValueError(f"gather concatenates along dim {dim}, so {where} must have the same shape in every "
                                 f"other dimension on every replica; got {shapes}.")
            return torch.cat([t.to(target) for t in items], dim)
        if first is None:
            if any(x is not None for x in items):
                raise TypeError(f"gather: {where} is None on some replicas and not on others.")
            return None
        if len(kinds) > 1:
            raise TypeError(f"gather: {where} has different types on different replicas: {sorted(map(str, kinds))}")
        if isinstance(first, dict):
            if any(x.keys() != first.keys() for x in items):
                raise ValueError(f"gather: {where} is a dict with different keys on different replicas: "
                                 f"{[sorted(map(str, x)) for x in items]}")
            return type(first)((k, merge([x[k] for x in items], f"{where}[{k!r}]")) for k in first)
        if isinstance(first, (tuple, list)):
            if len({len(x) for x in items}) > 1:
                raise ValueError(f"gather: {where} has different lengths on different replicas.")
            parts = [merge(list(col), f"{where}[{i}]") for i, col in enumerate(zip(*items))]
            return type(first)(*parts) if _is_namedtuple(first) else type(first)(parts)
        if _is_dataclass_instance(first):
            names = [f.name for f in dataclasses.fields(first) if f.init]
            return dataclasses.replace(first, **{k: merge([getattr(x, k) for x in items], f"{where}.{k}")
                                                 for k in names})
        if all(x == first for x in items[1:]):
            return first
        raise TypeError(f"gather cannot combine {where} = {items!r}: only tensors are concatenated; other values "
                        f"must be equal on every replica. Return a tensor instead.")

    return merge(list(outputs), "output")


# ----------------------------------------------------------------------------------------------------------------
# data_parallel
# ----------------------------------------------------------------------------------------------------------------
def data_parallel(module, inputs, device_ids, output_device=None, dim=0, module_kwargs=None):
    """``module(*inputs)`` computed by replicas on ``device_ids``, composed from the four primitives. Explained in 03_primitives.

    ``inputs`` is one argument or a tuple of positional arguments. With empty ``device_ids`` the module is simply
    called. The result lands on ``output_device`` (default ``device_ids[0]``).
    """
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    module_kwargs = dict(module_kwargs or {})
    if not device_ids:
        return module(*inputs, **module_kwargs)
    devices = _devices(device_ids, what="device_ids")
    output_device = devices[0] if output_device is None else _device(output_device, what="output_device")

    replicas = replicate(module, devices)
    if inputs or module_kwargs:
        inputs, kwargs = scatter_kwargs(inputs, module_kwargs, devices, dim)
    else:  # nothing to split: run one replica
        inputs, kwargs = ((),), ({},)
    replicas = replicas[:len(inputs)]  # a batch smaller than the device count uses fewer replicas
    outputs = parallel_apply(replicas, inputs, kwargs, devices[:len(inputs)])
    return gather(outputs, output_device, dim)


# ----------------------------------------------------------------------------------------------------------------
# The wrapper that forwards attributes
# ----------------------------------------------------------------------------------------------------------------
class AttrDataParallel(nn.DataParallel):
    """``nn.DataParallel`` whose wrapped module's attributes and methods are reachable on the wrapper. Explained in 02_wrapped_attributes.

    Lookup order for ``wrapper.name``:

    1. what Python finds by itself: the class's methods and properties (``forward``, ``train``, ``parameters`` ...)
       and the wrapper's own instance attributes (``device_ids``, ``training`` ...);
    2. the wrapper's own parameters, buffers and submodules, above all ``module``;
    3. the wrapped module's attribute of that name (methods, properties, submodules, plain attributes).

    So DataParallel's own names always win. Python calls ``__getattr__`` only when step 1 fails, which is why
    forwarding there cannot hide them. DataParallel has methods named ``replicate``, ``scatter``,
    ``parallel_apply`` and ``gather``: a wrapped module's methods of those names are reached through ``.module``. Assignments (``wrapper.name = value``) stay on the wrapper; to change the
    model, assign to ``wrapper.module.name``.

    Why the one-line ``def __getattr__(self, name): return getattr(self.module, name)`` recurses forever:
    ``nn.Module`` keeps submodules in the table ``self._modules``, not as ordinary attributes, so ``self.module``
    is itself found only through ``__getattr__``, which evaluates ``self.module`` again, and again...
    Asking ``nn.Module.__getattr__`` first (``super().__getattr__(name)``) is what looks in that table.
    """

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # step 2: parameters, buffers, submodules (incl. "module")
        except AttributeError:
            pass
        wrapped = self.__dict__.get("_modules", {}).get("module")
        if wrapped is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(wrapped, name)
        except AttributeError:
            if hasattr(type(wrapped), name):
                raise  # a property of the wrapped module failed inside: show its own error
            raise AttributeError(f"neither '{type(self).__name__}' nor the module it wraps "
                                 f"('{type(wrapped).__name__}') has an attribute '{name}'") from None


# ----------------------------------------------------------------------------------------------------------------
# Unwrapping and checkpoints
# ----------------------------------------------------------------------------------------------------------------
def _is_compiled(model):
    """True for what ``torch.compile(module)`` returns (only possible once torch._dynamo has been imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def unwrap(model):
    """The plain module under ``DataParallel``, ``DistributedDataParallel`` or ``torch.compile``. Explained in 02_wrapped_attributes."""
    while True:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod  # torch.compile's wrapper keeps the original module here
        else:
            return model


def state_dict_of(model):
    """The model's state dict without wrapper prefixes (no ``module.``, no ``_orig_mod.``). Explained in 02_wrapped_attributes."""
    plain = unwrap(model)
    _check_initialised(plain, action="save")
    return plain.state_dict()


class CheckpointMismatchError(RuntimeError):
    """A checkpoint's keys or shapes do not match the model; ``missing``, ``unexpected``, ``shapes`` say how."""

    def __init__(self, message, missing=(), unexpected=(), shapes=()):
        super().__init__(message)
        self.missing, self.unexpected, self.shapes = list(missing), list(unexpected), list(shapes)


def _is_torch_file(path):
    """True for a file written by ``torch.save`` (a zip archive holding ``<name>/data.pkl``)."""
    try:
        with zipfile.ZipFile(path) as z:
            return any(n.endswith("data.pkl") for n in z.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def save_checkpoint(model, path, **extra):
    """Save a plain or wrapped model (plus ``extra`` values such as ``epoch=3``) atomically. Explained in 02_wrapped_attributes.

    The keys carry no ``module.`` prefix, so the file loads into a plain or a wrapped model alike. The file is
    written to a temporary name and renamed, so a crash never leaves half a checkpoint. An existing checkpoint
    at ``path`` is replaced; any other existing file is left alone and an error is raised.
    """
    for key in ("model", "format"):
        if key in extra:
            raise ValueError(f"save_checkpoint: '{key}' is used by the checkpoint itself; name the extra value "
                             f"differently.")
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"save_checkpoint: {path} is a folder; give a file name such as {path / 'model.pt'}.")
    if path.exists() and not _is_torch_file(path):
        raise FileExistsError(f"save_checkpoint: {path} exists and is not a PyTorch checkpoint; it was left "
                              f"untouched. Choose another file name, or move that file away first.")
    atomic_torch_save({"format": CHECKPOINT_FORMAT, "model": state_dict_of(model), **extra}, path)
    return path


def _describe(missing, unexpected, shapes):
    lines = []
    if missing:
        lines.append(f"missing from the checkpoint ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        lines.append(f"unexpected in the checkpoint ({len(unexpected)}): {', '.join(unexpected)}")
    for key, have, want in shapes:
        lines.append(f"shape of '{key}': checkpoint {tuple(have)}, model {tuple(want)}")
    return "\n  ".join(lines)


def load_checkpoint(model, path, strict=True, map_location="cpu"):
    """Load a checkpoint into a plain or wrapped model and return the extra values saved with it. Explained in 02_wrapped_attributes.

    Reads files from :func:`save_checkpoint` and also bare state dicts (``torch.save(model.state_dict(), path)``),
    with or without the ``module.`` prefix that ``DataParallel`` adds. Every key must match: a missing or
    unexpected key raises :class:`CheckpointMismatchError` listing them. With ``strict=False`` the matching keys are
    loaded and the others are reported in a warning, never skipped silently; differing shapes are always an error.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: no checkpoint at {path}.")
    payload = torch.load(path, map_location=map_location, weights_only=True)
    if isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT:
        state = payload["model"]
        extra = {k: v for k, v in payload.items() if k not in ("format", "model")}
    elif isinstance(payload, dict) and any(isinstance(v, torch.Tensor) for v in payload.values()):
        state, extra = payload, {}  # a bare state dict: torch.save(model.state_dict(), path)
    else:
        keys = sorted(map(str, payload))[:10] if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"load_checkpoint: {path} holds neither a checkpoint from save_checkpoint nor a state dict "
                         f"(found {keys}). If the state dict sits under one of these keys, load the file with "
                         f"torch.load and call model.load_state_dict(...) on that entry.")
    plain = unwrap(model)
    expected = plain.state_dict()
    for prefix in ("module.", "_orig_mod."):  # left by wrappers; strip them unless the model itself uses them
        while state and all(k.startswith(prefix) for k in state) and not all(k.startswith(prefix) for k in expected):
            consume_prefix_in_state_dict_if_present(state, prefix)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [(k, state[k].shape, expected[k].shape) for k in expected
              if k in state and isinstance(state[k], torch.Tensor) and not is_lazy(expected[k])
              and state[k].shape != expected[k].shape]
    if shapes or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(
            f"{path} does not match {type(plain).__name__}:\n  {_describe(missing, unexpected, shapes)}\n"
            f"Build the same architecture as the one that was saved (or pass strict=False to load the matching "
            f"keys and be told about the rest).", missing, unexpected, shapes)
    if missing or unexpected:
        warnings.warn(f"load_checkpoint(strict=False) loaded the matching keys only:\n  "
                      f"{_describe(missing, unexpected, [])}", stacklevel=2)
    plain.load_state_dict(state, strict=strict)
    return extra
