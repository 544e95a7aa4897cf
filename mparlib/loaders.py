"""Mini-batches of Fashion-MNIST, two ways: the classic ``DataLoader`` over a data set of PIL images, and the
whole split resident on the device. Both give the same batches in the same order. Explained in 07_performance.
"""
import math

import torch
from PIL import Image

from .data import TEXT_LABELS, _check_resize, to_float
from .devices import check_device
from .errors import ConfigError
from .lang import tr


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

    ``root`` and ``source`` say where the files came from when :func:`mparlib.data.load_fashion_mnist` built it
    (``None`` otherwise).
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


class ResidentLoader:
    """The whole split as one uint8 tensor on ``device``, batched and normalised there. Explained in 07_performance.

    Each epoch draws a new permutation of the indices (``shuffle=True``) from ``generator``; batches are
    ``(B, 1, H, W)`` float32 in [0, 1] and ``(B,)`` int64 labels, the last batch may be smaller, as with a
    ``DataLoader(shuffle=True)``.
    """

    def __init__(self, images, labels, batch_size, *, shuffle, device=None, resize=None, generator=None):
        _check_pair(images, labels, "ResidentLoader")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ConfigError(tr(f"ResidentLoader: batch_size={batch_size!r}; use a positive int such as 256.",
                                 f"ResidentLoader: batch_size={batch_size!r} は使えません。256 のような正の整数を"
                                 "指定してください。"))
        if not isinstance(shuffle, bool) or not (generator is None or isinstance(generator, torch.Generator)):
            raise ConfigError(tr("ResidentLoader: shuffle must be True or False and generator a torch.Generator "
                                 f"or None; got shuffle={shuffle!r}, generator={generator!r}.",
                                 "ResidentLoader: shuffle は True か False、generator は torch.Generator か None に"
                                 f"してください。渡されたのは shuffle={shuffle!r}、generator={generator!r} です。"))
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
