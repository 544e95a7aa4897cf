"""Fashion-MNIST as mini-batches, two ways, and its class names. Explained in 00_setup (loading, class names).

The two iterators are compared in 07_performance: the classic ``DataLoader`` over a data set of PIL images
(:class:`FashionMNIST`), and the whole split resident on the device (:class:`ResidentLoader`); both give the same
batches in the same order. The files are found, read and checked by :mod:`mparlib.sources`; the copy used is
recorded: ``train_iter.dataset.source`` says which folder and why (printed on request only, so that stored
notebook outputs hold no absolute paths), and the ``mparlib.data`` logger reports it at INFO level.
"""
import math
import os

import torch
import torch.nn.functional as F
from PIL import Image

from .checks import flag, is_int, positive_int
from .devices import check_device
from .errors import ConfigError
from .lang import language, tr
from .sources import locate, read_split

TEXT_LABELS = {
    "en": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    "ja": ("Tシャツ/トップス", "ズボン", "プルオーバー", "ドレス", "コート",
           "サンダル", "シャツ", "スニーカー", "バッグ", "アンクルブーツ"),
}


def text_labels(indices, lang=None):
    """Class names of label indices in English or Japanese (default: the notebook's language). Explained in 00_setup.

    ``text_labels([0, 9])`` gives ``['T-shirt/top', 'Ankle boot']``; with ``lang="ja"``
    ``['Tシャツ/トップス', 'アンクルブーツ']``. A single int (or a 0-d tensor) gives a single name.
    """
    lang = language() if lang is None else lang
    if lang not in TEXT_LABELS:
        raise ConfigError(tr(f"lang={lang!r} is not a course language; use one of {tuple(TEXT_LABELS)}.",
                             f"lang={lang!r} はコースの言語ではありません。{tuple(TEXT_LABELS)} のどれかを指定して"
                             "ください。"))
    names = TEXT_LABELS[lang]
    indices = indices.tolist() if hasattr(indices, "tolist") else indices  # tensors and NumPy arrays

    def name(i):
        if not (hasattr(i, "__index__") and not isinstance(i, bool) and 0 <= i.__index__() < len(names)):
            raise ConfigError(tr(f"text_labels: {i!r} is not a class index; labels are the ints 0-9.",
                                 f"text_labels: {i!r} はクラスの番号ではありません。ラベルは 0 から 9 の整数です。"))
        return names[i.__index__()]

    if isinstance(indices, str) or not hasattr(indices, "__iter__"):
        return name(indices)
    return [name(i) for i in indices]


# --- turning bytes into batches -----------------------------------------------------------------------------------
def _pair_of_sizes(value, from_int):
    """``value`` as a pair of positive ints (an int ``n`` becomes ``from_int(n)``), or None if it is not one."""
    pair = from_int(value) if is_int(value) else value
    ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(is_int(k) and k > 0 for k in pair)
    return tuple(pair) if ok else None


def _check_resize(resize, what):
    """``None`` or ``(h, w)`` of positive ints; an int ``n`` means ``(n, n)``."""
    if resize is None:
        return None
    size = _pair_of_sizes(resize, lambda n: (n, n))
    if size is None:
        raise ConfigError(tr(f"{what}: resize={resize!r}; use None, a positive int or a pair (height, width).",
                             f"{what}: resize={resize!r} は使えません。None、正の整数、または (高さ, 幅) の組を"
                             "指定してください。"))
    return size


def to_float(images, resize=None):
    """uint8 images ``(B, 28, 28)`` -> float32 ``(B, 1, H, W)`` in [0, 1], as ``ToTensor``. Explained in 06_ddp.

    Runs on whatever device the images are on; ``resize`` (an int or ``(h, w)``) resizes bilinearly, antialiased.
    """
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 3:
        got = f"a {images.dtype} tensor of shape {tuple(images.shape)}" if isinstance(images, torch.Tensor) \
            else type(images).__name__
        raise ConfigError(tr(f"to_float takes uint8 images of shape (B, H, W), as read_split returns them; got {got}.",
                             "to_float には read_split が返すような形 (B, H, W) の uint8 の画像を渡してください。"
                             f"渡されたのは {got} です。"))
    size = _check_resize(resize, "to_float")
    x = images.unsqueeze(1).float().div_(255)  # (B, 1, 28, 28)
    if size is not None:
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return x


def _check_pair(images, labels, what):
    """``images (N, 28, 28)`` uint8 and ``labels (N,)`` integers, as read_split returns them."""
    ok = (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.dim() == 3
          and isinstance(labels, torch.Tensor) and labels.dim() == 1 and not labels.is_floating_point()
          and len(images) == len(labels))
    if not ok:
        def shown(t):
            return f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ConfigError(tr(f"{what} takes uint8 images (N, H, W) and integer labels (N,), as read_split returns "
                             f"them; got images {shown(images)} and labels {shown(labels)}.",
                             f"{what} には read_split が返すような uint8 の画像 (N, H, W) と整数のラベル (N,) を"
                             f"渡してください。渡されたのは画像 {shown(images)}、ラベル {shown(labels)} です。"))


class FashionMNIST(torch.utils.data.Dataset):
    """torchvision-style data set: item ``i`` is ``(transform(PIL image), int label)``. Explained in 07_performance.

    ``root`` and ``source`` say where the files came from when :func:`load_fashion_mnist` built it (``None``
    otherwise).
    """

    classes = list(TEXT_LABELS["en"])
    root = source = None

    def __init__(self, images, labels, transform=None):
        _check_pair(images, labels, "FashionMNIST")
        if transform is not None and not callable(transform):
            raise ConfigError(tr(f"FashionMNIST: transform must be callable (e.g. transforms.ToTensor()), got "
                                 f"{type(transform).__name__}.",
                                 "FashionMNIST: transform には呼び出せるもの（transforms.ToTensor() など）を渡して"
                                 f"ください。渡されたのは {type(transform).__name__} です。"))
        self.data, self.targets, self.transform = images, labels, transform  # (N, 28, 28) uint8, (N,) int64

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, i):
        img = Image.fromarray(self.data[i].numpy())  # 8-bit greyscale, as torchvision's FashionMNIST
        return (self.transform(img) if self.transform else img), int(self.targets[i])


class ResidentLoader:
    """The whole split as one uint8 tensor on ``device``, batched and normalised there. Explained in 07_performance.

    Each epoch draws a new permutation of the indices (``shuffle=True``) from ``generator``; batches are
    ``(B, 1, H, W)`` float32 in [0, 1] and ``(B,)`` int64 labels, the last batch may be smaller, as with a
    ``DataLoader(shuffle=True)``.
    """

    def __init__(self, images, labels, batch_size, *, shuffle, device=None, resize=None, generator=None):
        _check_pair(images, labels, "ResidentLoader")
        positive_int(batch_size, "batch_size", 256, "ResidentLoader")
        flag(shuffle, "shuffle", "ResidentLoader")
        if not (generator is None or isinstance(generator, torch.Generator)):
            raise ConfigError(tr(f"ResidentLoader: generator={generator!r}: use a torch.Generator or None.",
                                 f"ResidentLoader: generator={generator!r} は使えません。torch.Generator か None を"
                                 "指定してください。"))
        resize = _check_resize(resize, "ResidentLoader")
        self.device = check_device("cpu" if device is None else device, "device")
        self.images = images.to(self.device)  # (N, 28, 28) uint8: 47 MB for the train set
        self.labels = labels.to(self.device)  # (N,) int64
        self.batch_size, self.shuffle, self.resize, self.generator = batch_size, shuffle, resize, generator
        self.dataset = FashionMNIST(images, labels)  # for len(loader.dataset), as with a DataLoader

    def __len__(self):
        return math.ceil(len(self.labels) / self.batch_size)

    def __iter__(self):
        n, b = len(self.labels), self.batch_size
        order = torch.randperm(n, generator=self.generator).to(self.device) if self.shuffle else None
        for start in range(0, n, b):
            idx = order[start:start + b] if order is not None else slice(start, start + b)
            yield to_float(self.images[idx], self.resize), self.labels[idx]


class _EpochShuffle(torch.utils.data.Sampler):
    """A new permutation each epoch from its own generator: the same order as :class:`ResidentLoader`'s."""

    def __init__(self, n, generator):
        self.n, self.generator = n, generator

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.generator).tolist())


class _OnDevice:
    """A DataLoader whose batches are moved to ``device``."""

    def __init__(self, loader, device):
        self.loader, self.device, self.dataset = loader, device, loader.dataset

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for x, y in self.loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


# --- loading ------------------------------------------------------------------------------------------------------
def _check_options(batch_size, subset, resize, shuffle_seed, num_workers, resident):
    """The arguments of :func:`load_fashion_mnist` checked before any file is read: ``(sizes, resize)``."""
    where = "load_fashion_mnist"
    positive_int(batch_size, "batch_size", 256, where)
    resize = _check_resize(resize, where)
    if shuffle_seed is not None and not (is_int(shuffle_seed) and -2**63 <= shuffle_seed < 2**64):
        raise ConfigError(tr(f"{where}: shuffle_seed={shuffle_seed!r}: use an int (e.g. 0), or None to seed from "
                             "torch's global generator.",
                             f"{where}: shuffle_seed={shuffle_seed!r} は使えません。整数（0 など）か、torch の大域的な"
                             "乱数生成器から決めるなら None を指定してください。"))
    flag(resident, "resident", where, allow_none=True)
    if num_workers is not None:
        positive_int(num_workers, "num_workers", 0, where, minimum=0)
        if resident and num_workers > 0:
            raise ConfigError(tr(
                f"{where}: num_workers={num_workers} applies to the classic iterator (resident=False); the resident "
                "one makes batches on the device without worker processes. Leave out num_workers or pass "
                "resident=False.",
                f"{where}: num_workers={num_workers} は従来のイテレータ（resident=False）のための設定です。常駐の"
                "イテレータはワーカープロセスを使わずにデバイス上でバッチを作ります。num_workers を省くか "
                "resident=False を指定してください。"))
    sizes = (None, None) if subset is None else _pair_of_sizes(subset, lambda n: (n, max(1, n // 6)))
    if sizes is None:
        raise ConfigError(tr(f"subset={subset!r}: use None (everything), a positive int n (the first n training "
                             "examples and the first n // 6 test examples) or a pair (n_train, n_test).",
                             f"subset={subset!r} は使えません。None（すべて）、正の整数 n（訓練用の最初の n個と"
                             "テスト用の最初の n // 6個）、または組 (n_train, n_test) を指定してください。"))
    return sizes, resize


def _classic_loaders(splits, batch_size, resize, device, num_workers, seed):
    """d2l's iterators: a DataLoader over PIL images with ToTensor, batches moved to ``device`` if one is given."""
    from torchvision import transforms

    resizing = [transforms.Resize(resize, antialias=True)] if resize else []
    transform = transforms.Compose([transforms.ToTensor()] + resizing)
    workers = min(4, os.cpu_count() or 1) if num_workers is None else num_workers
    generator = torch.Generator().manual_seed(seed)
    loaders = []
    for (images, labels), train in zip(splits, (True, False)):
        data = FashionMNIST(images, labels, transform)
        loader = torch.utils.data.DataLoader(data, batch_size, sampler=_EpochShuffle(len(data), generator)
                                             if train else None, num_workers=workers,
                                             pin_memory=device is not None and device.type == "cuda",
                                             generator=torch.Generator().manual_seed(seed))  # worker seeds only
        loaders.append(_OnDevice(loader, device) if device is not None else loader)
    return loaders


def load_fashion_mnist(batch_size, *, root=None, subset=None, resize=None, device=None, resident=None,
                       shuffle_seed=0, num_workers=None, verify=True, download=True):
    """Return ``(train_iter, test_iter)`` over Fashion-MNIST, found offline when possible. Explained in 00_setup.

    - Files: see :func:`mparlib.sources.locate`. A folder you name with ``root`` or ``$MPARLIB_DATA`` is used or
      refused, never skipped. ``train_iter.dataset.source`` says which copy was used and why; ``.dataset.root`` is
      the folder. Files are checked (see :func:`mparlib.sources.read_split`), never modified.
    - ``subset``: ``n`` takes the first ``n`` training and first ``n // 6`` test examples (the 6:1 ratio of the
      full set); ``(n_train, n_test)`` sets both. The files are in random class order: the first ``n`` hold every
      class in roughly equal shares.
    - ``resize``: an int or ``(h, w)``; images are resized bilinearly (antialiased) from the [0, 1] tensor.
    - ``resident=False``: the classic iterator, a ``DataLoader`` over a torchvision-style data set with ToTensor
      (what d2l does), ``num_workers`` worker processes (default: ``min(4, CPUs)`` as d2l); batches are moved to
      ``device`` if one is given. ``resident=True``: a :class:`ResidentLoader` on ``device`` (default CPU).
      Default: resident when a ``device`` is given, classic otherwise. ``device`` must exist on this machine.
    - Both give the same batches in the same order for the same ``shuffle_seed``: train reshuffled every epoch,
      last partial batch kept; test in file order. ``shuffle_seed=None`` seeds from torch's global generator.
    """
    device = None if device is None else check_device(device, "device")
    resident = device is not None if resident is None else resident  # default: resident when a device is given
    sizes, resize = _check_options(batch_size, subset, resize, shuffle_seed, num_workers, resident)
    folder, source = locate(root, download=download, why=True)
    splits = [read_split(folder, s, verify=verify) for s in ("train", "test")]
    for k, ((images, labels), n, name) in enumerate(zip(splits, sizes, ("training", "test"))):
        if n is not None and n > len(labels):
            raise ConfigError(tr(f"subset={subset!r} asks for {n} {name} examples; the data in {folder} has "
                                 f"{len(labels)}.",
                                 f"subset={subset!r} は{'訓練' if k == 0 else 'テスト'}用の例を {n}個求めていますが、"
                                 f"{folder} のデータには {len(labels)}個しかありません。"))
        splits[k] = (images[:n], labels[:n])
    seed = int(torch.randint(2**62, ())) if shuffle_seed is None else shuffle_seed
    if resident:
        generator = torch.Generator().manual_seed(seed)
        loaders = [ResidentLoader(images, labels, batch_size, shuffle=train, device=device, resize=resize,
                                  generator=generator) for (images, labels), train in zip(splits, (True, False))]
    else:
        loaders = _classic_loaders(splits, batch_size, resize, device, num_workers, seed)
    for loader in loaders:
        loader.dataset.root, loader.dataset.source = folder, source
    return tuple(loaders)
