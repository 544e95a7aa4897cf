"""Fashion-MNIST offline: read and check the files, and serve mini-batches in two ways.

Explained in 00_setup (loading, class names); the two iterators are compared in 07_performance.

Where the files come from is :mod:`mparlib.sources`: a folder you name (``root=`` or ``$MPARLIB_DATA``) is used
or refused, never skipped; otherwise the user cache, the Debian package, then a download. The copy used is
recorded: ``train_iter.dataset.source`` says which folder and why (printed on request only, so that stored
notebook outputs hold no absolute paths), and the ``mparlib.data`` logger reports it at INFO level.
"""
import gzip
import hashlib
import logging
import math
import os
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

from . import sources
from .devices import check_device
from .errors import ConfigError, CorruptDataError, DataNotFoundError
from .lang import tr
from .sources import FILES, STEMS, SYSTEM_DIR, _as_folder, _find, _inventory, _problems, locate  # noqa: F401

log = logging.getLogger(__name__)

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


def text_labels(indices, lang=None):
    """Class names of label indices in English or Japanese (default: the notebook's language). Explained in 00_setup.

    ``text_labels([0, 9])`` gives ``['T-shirt/top', 'Ankle boot']``; with ``lang="ja"``
    ``['Tシャツ/トップス', 'アンクルブーツ']``. A single int (or a 0-d tensor) gives a single name.
    """
    if lang is None:
        from .lang import language as current_lang
        lang = current_lang()
    if lang not in TEXT_LABELS:
        raise ConfigError(tr(f"lang={lang!r} is not a course language; use one of {tuple(TEXT_LABELS)}.",
                             f"lang={lang!r} はコースの言語ではありません。{tuple(TEXT_LABELS)} のどれかを指定して"
                             "ください。"))
    names = TEXT_LABELS[lang]
    indices = indices.tolist() if hasattr(indices, "tolist") else indices  # tensors and NumPy arrays

    def name(i):
        ok = hasattr(i, "__index__") and not isinstance(i, bool) and 0 <= i.__index__() < len(names)
        if not ok:
            raise ConfigError(tr(f"text_labels: {i!r} is not a class index; labels are the ints 0-9.",
                                 f"text_labels: {i!r} はクラスの番号ではありません。ラベルは 0 から 9 の整数です。"))
        return names[i.__index__()]

    if isinstance(indices, str) or not hasattr(indices, "__iter__"):
        return name(indices)
    return [name(i) for i in indices]


# ----------------------------------------------------------------------------------------------------------------
# Reading and checking
# ----------------------------------------------------------------------------------------------------------------
def _corrupt(path, problem, problem_ja, own_data_hint=False):
    path = Path(path)
    if path.is_relative_to(sources.SYSTEM_DIR):
        fix = ("reinstall the package: `sudo apt-get install --reinstall dataset-fashion-mnist`",
               "パッケージを入れ直してください: `sudo apt-get install --reinstall dataset-fashion-mnist`")
    elif path.is_relative_to(sources._cache_dir()):
        fix = ("delete or rename it and call load_fashion_mnist() again online to download a fresh copy",
               "このファイルを削除するか名前を変え、オンラインで load_fashion_mnist() をもう一度呼んで新しいコピーを"
               "ダウンロードしてください")
    else:
        fix = ("replace it with a fresh copy of the original Fashion-MNIST file, or move it away so another copy "
               "is used", "元の Fashion-MNIST のファイルの新しいコピーで置き換えるか、別のコピーが使われるよう移動して"
               "ください")
    en = f"Fashion-MNIST file {path} {problem}. The file was left unchanged. To fix it, {fix[0]}."
    ja = f"Fashion-MNIST のファイル {path} {problem_ja}。ファイルは変更していません。直すには、{fix[1]}。"
    if own_data_hint:
        en += " If this is your own data in IDX format on purpose, pass verify=False."
        ja += "わざと IDX 形式の自前のデータを使っているなら、verify=False を指定してください。"
    return CorruptDataError(tr(en, ja))


_PARSED = {}  # (path, size, mtime) -> (tensor, sha256): loading twice in a notebook reads and checks each file once


def _read_idx(path, ndim):
    """Read an IDX file of unsigned bytes (plain or .gz) as a uint8 tensor; also return the sha256 of its content.

    The tensor is a fresh copy on every call: an in-place edit by one caller never reaches the next load.
    """
    path = Path(path)
    if path.is_dir():
        raise DataNotFoundError(tr(f"Fashion-MNIST: {path} is a folder, not a data file.",
                                   f"Fashion-MNIST: {path} はデータのファイルではなくフォルダです。"))
    try:
        st = path.stat()
    except FileNotFoundError:
        raise DataNotFoundError(tr(f"Fashion-MNIST: there is no file {path}.",
                                   f"Fashion-MNIST: ファイル {path} がありません。")) from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _PARSED:
        tensor, sha = _PARSED[key]
        return tensor.clone(), sha
    try:
        raw = path.read_bytes()
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as e:
        raise _corrupt(path, f"cannot be read or decompressed ({e})", f"を読めないか、展開できません（{e}）") from None
    magic = 0x0800 + ndim  # two zero bytes, type 0x08 (unsigned byte), number of dimensions
    header = 4 + 4 * ndim
    if len(raw) < 4 or int.from_bytes(raw[:4], "big") != magic:
        got = raw[:4].hex() if len(raw) >= 4 else f"{len(raw)} bytes"
        raise _corrupt(path, f"does not start with the IDX magic number 0x{magic:08x} (found {got}): "
                             f"it is not an IDX file of {ndim}-dimensional unsigned bytes",
                       f"は IDX のマジックナンバー 0x{magic:08x} で始まっていません（先頭は {got}）。{ndim}次元の符号なし"
                       "バイトの IDX ファイルではありません")
    if len(raw) < header:
        raise _corrupt(path, f"is truncated: its {len(raw)} bytes end inside the IDX header",
                       f"は途中で切れています。{len(raw)} バイトしかなく、IDX のヘッダの途中で終わっています")
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    size = header + math.prod(dims)
    if len(raw) != size:
        what = ("is truncated", "は途中で切れています") if len(raw) < size else \
            ("has extra bytes at the end", "の末尾に余分なバイトがあります")
        raise _corrupt(path, f"{what[0]}: its header announces shape {tuple(dims)}, i.e. {size} bytes, "
                             f"but it holds {len(raw)} bytes",
                       f"{what[1]}。ヘッダが示す形は {tuple(dims)}（{size} バイト）ですが、実際は {len(raw)} バイトです")
    sha = hashlib.sha256(raw).hexdigest()
    tensor = torch.frombuffer(bytearray(raw), dtype=torch.uint8, offset=header).reshape(dims)
    if len(_PARSED) >= 8:  # keep the cache small: the oldest entry goes
        _PARSED.pop(next(iter(_PARSED)))
    _PARSED[key] = (tensor, sha)
    return tensor.clone(), sha


def read_split(folder, split, *, verify=True):
    """Read and check one split: images ``(N, 28, 28)`` uint8 and labels ``(N,)`` int64. Explained in 07_performance.

    Always checked: IDX magic numbers, complete files, 28x28 images, as many labels as images, labels 0-9.
    With ``verify=True`` (default) also the counts (60,000 train / 10,000 test) and the sha256 of the decompressed
    content of the original Fashion-MNIST. ``verify=False`` accepts any well-formed IDX files of that shape: your own
    or a small made-up set (the course's tests use that). Every call returns fresh tensors.
    """
    if split not in FILES:
        raise ConfigError(tr(f"read_split: split={split!r}; use 'train' or 'test'.",
                             f"read_split: split={split!r} は使えません。'train' か 'test' を指定してください。"))
    if not isinstance(verify, bool):
        raise ConfigError(tr(f"verify={verify!r}; use True or False.",
                             f"verify={verify!r} です。True か False を指定してください。"))
    folder = _as_folder(folder, "read_split")
    img_stem, lab_stem = FILES[split]
    found, odd, missing = _inventory(folder)
    if img_stem not in found or lab_stem not in found:
        wrong = _problems({s: odd[s] for s in (img_stem, lab_stem) if s in odd},
                          [s for s in (img_stem, lab_stem) if s in missing])
        raise DataNotFoundError(tr(f"{folder} lacks the {split} split: " + "; ".join(wrong) + ".",
                                   f"{folder} には {split} の分割がそろっていません: " + "、".join(wrong) + "。"))
    img_path, lab_path = found[img_stem], found[lab_stem]
    images, img_sha = _read_idx(img_path, 3)
    labels, lab_sha = _read_idx(lab_path, 1)
    if verify:
        for path, n in ((img_path, len(images)), (lab_path, len(labels))):
            if n != COUNTS[split]:
                raise _corrupt(path, f"holds {n} examples; the {split} set has {COUNTS[split]}",
                               f"には {n}個の例が入っていますが、{split} の集合は {COUNTS[split]}個です", own_data_hint=True)
    if tuple(images.shape[1:]) != (28, 28):
        raise _corrupt(img_path, f"holds {images.shape[1]}x{images.shape[2]} images; Fashion-MNIST's are 28x28",
                       f"の画像は {images.shape[1]}x{images.shape[2]} ですが、Fashion-MNIST の画像は 28x28 です")
    if len(images) == 0 or len(labels) != len(images):
        raise _corrupt(lab_path, f"holds {len(labels)} labels but {img_path.name} holds {len(images)} images",
                       f"のラベルは {len(labels)}個ですが、{img_path.name} の画像は {len(images)}枚です")
    if int(labels.max()) > 9:
        raise _corrupt(lab_path, f"holds the label {int(labels.max())}; labels are the classes 0-9",
                       f"にラベル {int(labels.max())} があります。ラベルはクラス 0 から 9 です")
    if verify:
        for path, stem, sha in ((img_path, img_stem, img_sha), (lab_path, lab_stem, lab_sha)):
            if sha != SHA256[stem]:
                raise _corrupt(path, f"differs from the original Fashion-MNIST: the sha256 of its content is "
                                     f"{sha}, expected {SHA256[stem]}",
                               f"は元の Fashion-MNIST と違います。中身の sha256 は {sha} で、期待される値は "
                               f"{SHA256[stem]} です", own_data_hint=True)
    return images, labels.long()


# ----------------------------------------------------------------------------------------------------------------
# Turning bytes into batches
# ----------------------------------------------------------------------------------------------------------------
def _check_resize(resize, what):
    """``None`` or ``(h, w)`` of positive ints; an int ``n`` means ``(n, n)``."""
    if resize is None:
        return None
    pair = (resize, resize) if isinstance(resize, int) else resize
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in pair)):
        raise ConfigError(tr(f"{what}: resize={resize!r}; use None, a positive int or a pair (height, width).",
                             f"{what}: resize={resize!r} は使えません。None、正の整数、または (高さ, 幅) の組を"
                             "指定してください。"))
    return tuple(pair)


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


def _sizes(subset):
    if subset is None:
        return None, None
    pair = (subset, max(1, subset // 6)) if isinstance(subset, int) and not isinstance(subset, bool) else subset
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in pair)):
        raise ConfigError(tr(f"subset={subset!r}: use None (everything), a positive int n (the first n training "
                             "examples and the first n // 6 test examples) or a pair (n_train, n_test).",
                             f"subset={subset!r} は使えません。None（すべて）、正の整数 n（訓練用の最初の n個と"
                             "テスト用の最初の n // 6個）、または組 (n_train, n_test) を指定してください。"))
    return tuple(pair)


def _check_options(batch_size, shuffle_seed, num_workers, resident):
    def bad(en, ja):
        raise ConfigError(tr(f"load_fashion_mnist: {en}", f"load_fashion_mnist: {ja}"))

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        bad(f"batch_size={batch_size!r}: use a positive int such as 256.",
            f"batch_size={batch_size!r} は使えません。256 のような正の整数を指定してください。")
    if shuffle_seed is not None and (isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int)
                                     or not -2**63 <= shuffle_seed < 2**64):
        bad(f"shuffle_seed={shuffle_seed!r}: use an int (e.g. 0), or None to seed from torch's global generator.",
            f"shuffle_seed={shuffle_seed!r} は使えません。整数（0 など）か、torch の大域的な乱数生成器から"
            "決めるなら None を指定してください。")
    if resident is not None and not isinstance(resident, bool):
        bad(f"resident={resident!r}: use True, False or None (resident when a device is given).",
            f"resident={resident!r} は使えません。True、False、または None（device を指定したとき常駐）を指定して"
            "ください。")
    if num_workers is not None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            bad(f"num_workers={num_workers!r}: use an int >= 0 (0 loads in the main process).",
                f"num_workers={num_workers!r} は使えません。0 以上の整数を指定してください（0 はメインプロセスで"
                "読み込みます）。")
        if resident and num_workers > 0:
            bad(f"num_workers={num_workers} applies to the classic iterator (resident=False); the resident one "
                "makes batches on the device without worker processes. Leave out num_workers or pass resident=False.",
                f"num_workers={num_workers} は従来のイテレータ（resident=False）のための設定です。常駐のイテレータは"
                "ワーカープロセスを使わずにデバイス上でバッチを作ります。num_workers を省くか resident=False を"
                "指定してください。")


def load_fashion_mnist(batch_size, *, root=None, subset=None, resize=None, device=None, resident=None,
                       shuffle_seed=0, num_workers=None, verify=True, download=True):
    """Return ``(train_iter, test_iter)`` over Fashion-MNIST, found offline when possible. Explained in 00_setup.

    - Files: see :func:`locate`. A folder you name with ``root`` or ``$MPARLIB_DATA`` is used or refused, never
      skipped. ``train_iter.dataset.source`` says which copy was used and why; ``.dataset.root`` is the folder.
      Files are checked (see :func:`read_split`), never modified.
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
    _check_options(batch_size, shuffle_seed, num_workers, resident)
    resize = _check_resize(resize, "load_fashion_mnist")
    sizes = _sizes(subset)
    folder, why = _find(root, download)
    source = tr(f"Fashion-MNIST: {folder} ({why})", f"Fashion-MNIST: {folder}（{why}）")
    log.info("%s", source)
    splits = [read_split(folder, s, verify=verify) for s in ("train", "test")]
    for k, ((images, labels), n, name) in enumerate(zip(splits, sizes, ("training", "test"))):
        if n is not None and n > len(labels):
            raise ConfigError(tr(f"subset={subset!r} asks for {n} {name} examples; the data in {folder} has "
                                 f"{len(labels)}.",
                                 f"subset={subset!r} は{'訓練' if k == 0 else 'テスト'}用の例を {n}個求めていますが、"
                                 f"{folder} のデータには {len(labels)}個しかありません。"))
        splits[k] = (images[:n], labels[:n])
    seed = int(torch.randint(2**62, ())) if shuffle_seed is None else shuffle_seed
    generator = torch.Generator().manual_seed(seed)
    from .loaders import FashionMNIST, ResidentLoader, _EpochShuffle, _OnDevice

    if resident:
        loaders = [ResidentLoader(images, labels, batch_size, shuffle=train, device=device, resize=resize,
                                  generator=generator) for (images, labels), train in zip(splits, (True, False))]
    else:
        from torchvision import transforms

        resizing = [transforms.Resize(resize, antialias=True)] if resize else []
        transform = transforms.Compose([transforms.ToTensor()] + resizing)
        workers = min(4, os.cpu_count() or 1) if num_workers is None else num_workers
        loaders = []
        for (images, labels), train in zip(splits, (True, False)):
            data = FashionMNIST(images, labels, transform)
            sampler = _EpochShuffle(len(data), generator) if train else None
            loader = torch.utils.data.DataLoader(data, batch_size, sampler=sampler, num_workers=workers,
                                                 pin_memory=device is not None and device.type == "cuda",
                                                 generator=torch.Generator().manual_seed(seed))  # worker seeds only
            loaders.append(_OnDevice(loader, device) if device is not None else loader)
    for loader in loaders:
        loader.dataset.root, loader.dataset.source = folder, source
    return tuple(loaders)
