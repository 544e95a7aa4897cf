"""Fashion-MNIST offline: find the files, check them, and serve mini-batches in two ways.

Explained in 00_setup (loading, class names); the two iterators are compared in 07_performance.
"""
import gzip
import hashlib
import http.client
import math
import os
import tempfile
import urllib.request
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # installed by `apt-get install dataset-fashion-mnist`
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
COUNTS = {"train": 60_000, "test": 10_000}
# sha256 of the *decompressed* IDX files of the original data set: the .gz bytes differ between mirrors and
# packagers (Debian recompresses them), the content does not.
SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
TEXT_LABELS = {
    "en": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
           "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    "ja": ("Tシャツ/トップス", "ズボン", "プルオーバー", "ドレス", "コート",
           "サンダル", "シャツ", "スニーカー", "バッグ", "アンクルブーツ"),
}


class DataNotFoundError(FileNotFoundError):
    """Fashion-MNIST is in none of the places searched and could not be downloaded. Explained in 00_setup."""


class CorruptDataError(ValueError):
    """A Fashion-MNIST file exists but is damaged or is not the data set expected. Explained in 00_setup."""


def text_labels(indices, lang=None):
    """Class names of label indices in English or Japanese (default: the notebook's language). Explained in 00_setup.

    ``text_labels([0, 9])`` gives ``['T-shirt/top', 'Ankle boot']``; with ``lang="ja"``
    ``['Tシャツ/トップス', 'アンクルブーツ']``. A single int gives a single name.
    """
    if lang is None:
        from .lang import lang as current_lang
        lang = current_lang()
    if lang not in TEXT_LABELS:
        raise ValueError(f"lang={lang!r} is not a course language; use one of {tuple(TEXT_LABELS)}.")
    names = TEXT_LABELS[lang]
    indices = indices.tolist() if torch.is_tensor(indices) else indices
    return names[indices] if isinstance(indices, int) else [names[int(i)] for i in indices]


def cache_dir():
    """The user cache folder for downloads: ``$XDG_CACHE_HOME/mparlib/fashion-mnist`` (default ``~/.cache/...``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mparlib" / "fashion-mnist"


def search_places(root=None):
    """The folders searched for the four files, in order, each with a note saying why. Explained in 00_setup.

    ``root`` (or, without it, ``$MPARLIB_DATA``), the user cache, then the Debian package's folder; each folder is
    also searched in torchvision's layout ``FOLDER/FashionMNIST/raw`` (where d2l and torchvision download to).
    """
    env = os.environ.get("MPARLIB_DATA")
    first = [(root, "root argument")] if root is not None else [(env, "$MPARLIB_DATA")] if env else []
    places = []
    for folder, why in [(Path(f).expanduser(), w) for f, w in first] + [
            (cache_dir(), "user cache"), (SYSTEM_DIR, "Debian package dataset-fashion-mnist")]:
        places += [(folder, why), (folder / "FashionMNIST" / "raw", why + ", torchvision layout")]
    return places


def _files_in(folder):
    """Map each of the four file names to the file in ``folder`` (plain preferred over .gz); missing ones left out."""
    found = {}
    for stem in FILES["train"] + FILES["test"]:
        for name in (stem, stem + ".gz"):
            if (folder / name).is_file():
                found[stem] = folder / name
                break
    return found


def locate(root=None, *, download=True):
    """Return the folder holding all four Fashion-MNIST files, downloading them if allowed. Explained in 00_setup."""
    searched = []
    for folder, why in search_places(root):
        found = _files_in(folder)
        if len(found) == 4:
            return folder
        note = f"found {len(found)} of the 4 files" if found else "no data files"
        searched.append(f"{folder}  ({why}: {note})")
    target = cache_dir()
    if download:
        try:
            _download(target)
            return target
        except OSError as e:  # no network, mirror down, disk full, bad download: all end in the same advice
            searched.append(f"download with torchvision's mirror list into {target}: failed ({e})")
    else:
        searched.append("download: not tried (download=False)")
    names = ", ".join(f"{s}[.gz]" for s in FILES["train"] + FILES["test"])
    raise DataNotFoundError(
        "Fashion-MNIST was not found. Places searched, in order:\n  - " + "\n  - ".join(searched) +
        "\nGet the data in one of two ways:\n"
        "  1. Offline: `sudo apt-get install dataset-fashion-mnist` (installs it in " + str(SYSTEM_DIR) + "),\n"
        f"     or copy the files {names} into a folder and pass root=FOLDER or set MPARLIB_DATA=FOLDER.\n"
        f"  2. Online: connect to the internet and call load_fashion_mnist() again; torchvision's mirror\n"
        f"     is then downloaded into {target}.")


def _download(target):
    """Download the four .gz files from torchvision's mirror list, check them, then move them into ``target``."""
    from torchvision.datasets import FashionMNIST
    from tqdm.auto import tqdm

    target.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target) as tmp:
        for name, _md5 in FashionMNIST.resources:  # content is checked below by sha256 of the decompressed bytes
            errors = []
            for mirror in FashionMNIST.mirrors:
                try:
                    with urllib.request.urlopen(mirror + name, timeout=30) as r, open(Path(tmp, name), "wb") as f, \
                            tqdm(total=int(r.headers.get("Content-Length") or 0) or None, unit="B",
                                 unit_scale=True, desc=name, disable=_quiet()) as bar:
                        while chunk := r.read(1 << 16):
                            bar.update(f.write(chunk))
                    break
                except (OSError, ValueError, http.client.HTTPException) as e:
                    errors.append(f"{mirror}{name}: {e}")
            else:
                raise OSError("; ".join(errors))
        try:
            for split in FILES:
                read_split(Path(tmp), split, verify=True)
        except CorruptDataError as e:
            raise OSError(f"the downloaded files are not the original data set: {e}") from None
        finally:
            for key in [k for k in _PARSED if k[0].startswith(str(Path(tmp).resolve()))]:
                del _PARSED[key]  # forget the temporary copies
        for name, _md5 in FashionMNIST.resources:
            if not (target / name).exists():  # never overwrite a file that is already there
                os.replace(Path(tmp, name), target / name)


def _quiet():
    return "PYTEST_CURRENT_TEST" in os.environ or bool(os.environ.get("MPARLIB_QUIET"))


def _corrupt(path, problem, own_data_hint=False):
    path = Path(path)
    if path.is_relative_to(SYSTEM_DIR):
        fix = "reinstall the package: `sudo apt-get install --reinstall dataset-fashion-mnist`"
    elif path.is_relative_to(cache_dir()):
        fix = "delete or rename it and call load_fashion_mnist() again online to download a fresh copy"
    else:
        fix = "replace it with a fresh copy of the original Fashion-MNIST file, or move it away so another copy is used"
    msg = f"Fashion-MNIST file {path} {problem}. The file was left unchanged. To fix it, {fix}."
    if own_data_hint:
        msg += " If this is your own data in IDX format on purpose, pass verify=False."
    return CorruptDataError(msg)


_PARSED = {}  # (path, size, mtime) -> (tensor, sha256): loading twice in a notebook reads each file once


def read_idx(path, ndim):
    """Read an IDX file of unsigned bytes (plain or .gz) as a uint8 tensor; also return the sha256 of its content."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _PARSED:
        return _PARSED[key]
    try:
        raw = path.read_bytes()
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as e:
        raise _corrupt(path, f"cannot be read or decompressed ({e})") from None
    magic = 0x0800 + ndim  # two zero bytes, type 0x08 (unsigned byte), number of dimensions
    header = 4 + 4 * ndim
    if len(raw) < 4 or int.from_bytes(raw[:4], "big") != magic:
        got = raw[:4].hex() if len(raw) >= 4 else f"{len(raw)} bytes"
        raise _corrupt(path, f"does not start with the IDX magic number 0x{magic:08x} (found {got}): "
                             f"it is not an IDX file of {ndim}-dimensional unsigned bytes")
    if len(raw) < header:
        raise _corrupt(path, f"is truncated: its {len(raw)} bytes end inside the IDX header")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    size = header + math.prod(dims)
    if len(raw) != size:
        what = "is truncated" if len(raw) < size else "has extra bytes at the end"
        raise _corrupt(path, f"{what}: its header announces shape {tuple(dims)}, i.e. {size} bytes, "
                             f"but it holds {len(raw)} bytes")
    sha = hashlib.sha256(raw).hexdigest()
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).reshape(dims)
    if len(_PARSED) >= 8:  # keep the cache small: the oldest entry goes
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = (tensor, sha)
    return tensor, sha


def read_split(folder, split, *, verify=True):
    """Read and check one split: images ``(N, 28, 28)`` uint8 and labels ``(N,)`` int64. Explained in 00_setup.

    Always checked: IDX magic numbers, complete files, 28x28 images, as many labels as images, labels 0-9.
    With ``verify=True`` (default) also the counts (60,000 train / 10,000 test) and the sha256 of the decompressed
    content of the original Fashion-MNIST. ``verify=False`` accepts any well-formed IDX files of that shape: your own
    or a small made-up set (the course's tests use that).
    """
    files = _files_in(Path(folder))
    img_stem, lab_stem = FILES[split]
    if img_stem not in files or lab_stem not in files:
        raise DataNotFoundError(f"{folder} lacks {img_stem}[.gz] or {lab_stem}[.gz].")
    img_path, lab_path = files[img_stem], files[lab_stem]
    images, img_sha = read_idx(img_path, 3)
    labels, lab_sha = read_idx(lab_path, 1)
    if verify:
        for path, n in ((img_path, len(images)), (lab_path, len(labels))):
            if n != COUNTS[split]:
                raise _corrupt(path, f"holds {n} examples; the {split} set has {COUNTS[split]}", own_data_hint=True)
    if tuple(images.shape[1:]) != (28, 28):
        raise _corrupt(img_path, f"holds {images.shape[1]}x{images.shape[2]} images; Fashion-MNIST's are 28x28")
    if len(images) == 0 or len(labels) != len(images):
        raise _corrupt(lab_path, f"holds {len(labels)} labels but {img_path.name} holds {len(images)} images")
    if int(labels.max()) > 9:
        raise _corrupt(lab_path, f"holds the label {int(labels.max())}; labels are the classes 0-9")
    if verify:
        for path, stem, sha in ((img_path, img_stem, img_sha), (lab_path, lab_stem, lab_sha)):
            if sha != SHA256[stem]:
                raise _corrupt(path, f"differs from the original Fashion-MNIST: the sha256 of its content is "
                                     f"{sha}, expected {SHA256[stem]}", own_data_hint=True)
    return images, labels.long()


class FashionMNIST(torch.utils.data.Dataset):
    """torchvision-style data set: item ``i`` is ``(transform(PIL image), int label)``. Explained in 00_setup."""

    classes = list(TEXT_LABELS["en"])

    def __init__(self, images, labels, transform=None):
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


def to_float(images, resize=None):
    """uint8 images ``(B, 28, 28)`` -> float32 ``(B, 1, H, W)`` in [0, 1], as ``ToTensor``. Explained in 00_setup.

    Runs on whatever device the images are on; ``resize`` (an int or ``(h, w)``) resizes bilinearly, antialiased.
    """
    x = images.unsqueeze(1).float().div_(255)  # (B, 1, 28, 28)
    if resize is not None:
        size = (resize, resize) if isinstance(resize, int) else tuple(resize)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    return x


class ResidentLoader:
    """The whole split as one uint8 tensor on ``device``, batched and normalised there. Explained in 07_performance.

    Each epoch draws a new permutation of the indices (``shuffle=True``) from ``generator``; batches are
    ``(B, 1, H, W)`` float32 in [0, 1] and ``(B,)`` int64 labels, the last batch may be smaller, as with a
    ``DataLoader(shuffle=True)``.
    """

    def __init__(self, images, labels, batch_size, *, shuffle, device=None, resize=None, generator=None):
        self.device = torch.device(device or "cpu")
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


def _sizes(subset):
    if subset is None:
        return None, None
    pair = (subset, max(1, subset // 6)) if isinstance(subset, int) and not isinstance(subset, bool) else subset
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in pair)):
        raise ValueError(f"subset={subset!r}: use None (everything), a positive int n (the first n training "
                         "examples and the first n // 6 test examples) or a pair (n_train, n_test).")
    return tuple(pair)


def load_fashion_mnist(batch_size, *, root=None, subset=None, resize=None, device=None, resident=None,
                       shuffle_seed=0, num_workers=None, verify=True, download=True):
    """Return ``(train_iter, test_iter)`` over Fashion-MNIST, found offline when possible. Explained in 00_setup.

    - Files: ``root`` (or ``$MPARLIB_DATA``), the user cache, ``/usr/share/datasets/fashion-mnist``, then a download
      into the user cache (see :func:`search_places`). Files are checked (see :func:`read_split`), never modified.
    - ``subset``: ``n`` takes the first ``n`` training and first ``n // 6`` test examples (the 6:1 ratio of the
      full set); ``(n_train, n_test)`` sets both. The files are in random class order: the first ``n`` hold every
      class in roughly equal shares.
    - ``resize``: an int or ``(h, w)``; images are resized bilinearly (antialiased) from the [0, 1] tensor.
    - ``resident=False``: the classic iterator, a ``DataLoader`` over a torchvision-style data set with ToTensor
      (what d2l does), ``num_workers`` worker processes (default: ``min(4, CPUs)`` as d2l); batches are moved to
      ``device`` if one is given. ``resident=True``: a :class:`ResidentLoader` on ``device`` (default CPU).
      Default: resident when a ``device`` is given, classic otherwise.
    - Both give the same batches in the same order for the same ``shuffle_seed``: train reshuffled every epoch,
      last partial batch kept; test in file order. ``shuffle_seed=None`` seeds from torch's global generator.
    """
    if not (isinstance(batch_size, int) and batch_size > 0):
        raise ValueError(f"batch_size={batch_size!r}: use a positive int such as 256.")
    if isinstance(resize, int):
        resize = (resize, resize)
    if resize is not None and not (isinstance(resize, (tuple, list)) and len(resize) == 2
                                   and all(isinstance(k, int) and k > 0 for k in resize)):
        raise ValueError(f"resize={resize!r}: use None, a positive int or a pair (height, width).")
    resize = tuple(resize) if resize is not None else None
    folder = locate(root, download=download)
    splits = [read_split(folder, s, verify=verify) for s in ("train", "test")]
    for k, ((images, labels), n, name) in enumerate(zip(splits, _sizes(subset), ("training", "test"))):
        if n is not None and n > len(labels):
            raise ValueError(f"subset={subset!r} asks for {n} {name} examples; the data in {folder} has {len(labels)}.")
        splits[k] = (images[:n], labels[:n])
    seed = int(torch.randint(2**62, ())) if shuffle_seed is None else shuffle_seed
    generator = torch.Generator().manual_seed(seed)
    if resident or (resident is None and device is not None):
        return tuple(ResidentLoader(images, labels, batch_size, shuffle=train, device=device, resize=resize,
                                    generator=generator)
                     for (images, labels), train in zip(splits, (True, False)))
    from torchvision import transforms

    resizing = [transforms.Resize(resize, antialias=True)] if resize else []
    transform = transforms.Compose([transforms.ToTensor()] + resizing)
    workers = min(4, os.cpu_count() or 1) if num_workers is None else num_workers
    pin = device is not None and torch.device(device).type == "cuda"
    loaders = []
    for (images, labels), train in zip(splits, (True, False)):
        data = FashionMNIST(images, labels, transform)
        sampler = _EpochShuffle(len(data), generator) if train else None
        loader = torch.utils.data.DataLoader(data, batch_size, sampler=sampler, num_workers=workers, pin_memory=pin,
                                             generator=torch.Generator().manual_seed(seed))  # worker seeds only
        loaders.append(_OnDevice(loader, device) if device is not None else loader)
    return tuple(loaders)
