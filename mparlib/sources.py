"""Fashion-MNIST's files: where they are, and reading and checking them. Explained in 07_performance.

A folder you name (``root=`` or ``$MPARLIB_DATA``) is used as it is or refused with the reason (missing, a file,
incomplete, a folder where a file should be); it is never skipped for another copy. Without one, the user cache
and then the Debian package's folder are searched (partial copies there are skipped and mentioned), and the last
resort is a download into the user cache, checked by the same reader before it is moved there. :func:`read_split`
reads and checks the IDX files of one split; :mod:`mparlib.data` turns them into mini-batches.
"""
import difflib
import gzip
import hashlib
import http.client
import logging
import math
import os
import tempfile
import urllib.request
import zlib
from pathlib import Path, PurePath

import torch

from .checks import flag, one_of
from .errors import ConfigError, CorruptDataError, DataNotFoundError
from .lang import tr
from .progress import quiet

log = logging.getLogger("mparlib.data")

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # installed by `apt-get install dataset-fashion-mnist`
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
STEMS = FILES["train"] + FILES["test"]
COUNTS = {"train": 60_000, "test": 10_000}
# sha256 of the *decompressed* IDX files of the original data set: the .gz bytes differ between mirrors and
# packagers (Debian recompresses them), the content does not.
SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}


def _cache_dir():
    """The user cache folder for downloads: ``$XDG_CACHE_HOME/mparlib/fashion-mnist`` (default ``~/.cache/...``)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG rule: relative values are ignored
    return base / "mparlib" / "fashion-mnist"


# --- reading and checking -----------------------------------------------------------------------------------------
def _corrupt(path, problem, problem_ja, own_data_hint=False):
    if path.is_relative_to(SYSTEM_DIR):
        fix = ("reinstall the package: `sudo apt-get install --reinstall dataset-fashion-mnist`",
               "パッケージを入れ直してください: `sudo apt-get install --reinstall dataset-fashion-mnist`")
    elif path.is_relative_to(_cache_dir()):
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


MAX_IDX_BYTES = 1 << 30  # the largest decompressed IDX file read (Fashion-MNIST's largest is 47 MB)


def _inflate(path, ndim):
    """Decompress a .gz IDX file, but never past the size its own header announces (plus one byte, to tell that
    there is more): a small file that would inflate to gigabytes is refused after reading what the data can be."""
    header = 4 + 4 * ndim
    with gzip.open(path, "rb") as f:
        head = f.read(header)
        if len(head) < header or int.from_bytes(head[:4], "big") != 0x0800 + ndim:
            return head  # not an IDX header: the caller names the problem
        size = header + math.prod(int.from_bytes(head[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
        if size > MAX_IDX_BYTES:
            raise _corrupt(path, f"announces {size} bytes of data in its header, more than the {MAX_IDX_BYTES} bytes "
                                 "an IDX file of this course may hold; it was not decompressed",
                           f"のヘッダは {size} バイトのデータを示していますが、このコースの IDX ファイルの上限 "
                           f"{MAX_IDX_BYTES} バイトを超えているので、展開していません")
        return head + f.read(size - header + 1)


def _read_idx(path, ndim):
    """Read an IDX file of unsigned bytes (plain or .gz) found by :func:`_inventory` as a uint8 tensor; also return
    the sha256 of its content.

    The tensor is a fresh copy on every call: an in-place edit by one caller never reaches the next load.
    """
    try:
        st = path.stat()
    except FileNotFoundError:  # removed since the folder was listed
        raise DataNotFoundError(tr(f"Fashion-MNIST: there is no file {path}.",
                                   f"Fashion-MNIST: ファイル {path} がありません。")) from None
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key in _PARSED:
        tensor, sha = _PARSED[key]
        return tensor.clone(), sha
    try:
        raw = _inflate(path, ndim) if path.suffix == ".gz" else path.read_bytes()
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
    if len(raw) > size and path.suffix == ".gz":  # _inflate stopped one byte past what the header announces
        raise _corrupt(path, f"has extra bytes at the end: its header announces shape {tuple(dims)}, i.e. {size} "
                             "bytes, but it decompresses to more; decompression was stopped there (a file that "
                             "inflates beyond its own header, such as a zip bomb, is never read in full)",
                       f"の末尾に余分なバイトがあります。ヘッダが示す形は {tuple(dims)}（{size} バイト）ですが、展開すると"
                       "それより大きくなるので、そこで展開を止めました（ヘッダを超えて膨らむファイル、例えば zip 爆弾は、"
                       "最後まで読みません）")
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
    one_of(split, "split", tuple(FILES), "read_split")
    flag(verify, "verify", "read_split")
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


# --- finding the files --------------------------------------------------------------------------------------------
def _inventory(folder):
    """``(found, odd, missing)``: stem -> file present (plain preferred over .gz); stem -> what stands in its place
    (a folder, a dangling link); the stems with nothing at all."""
    found, odd = {}, {}
    for stem in STEMS:
        for name in (stem, stem + ".gz"):
            p = folder / name
            if p.is_file():
                found[stem] = p
                break
            if p.is_dir():
                odd.setdefault(stem, tr(f"{name} is a folder, not a file", f"{name} はファイルではなくフォルダです"))
            elif p.is_symlink():
                odd.setdefault(stem, tr(f"{name} is a link to nothing", f"{name} はリンク先のないリンクです"))
    missing = [s for s in STEMS if s not in found and s not in odd]
    return found, {s: v for s, v in odd.items() if s not in found}, missing


def _problems(odd, missing):
    """What is wrong with one folder's copy: one phrase per file, in the learner's language."""
    return list(odd.values()) + [tr(f"{s}[.gz] is missing", f"{s}[.gz] がありません") for s in missing]


def _count_note(found):
    return tr(f"found {len(found)} of the 4 files", f"4つのファイルのうち {len(found)}個だけがあります") if found else \
        tr("no data files", "データのファイルがありません")


def _refuse_named(folder, why, env, detail_en, detail_ja):
    names = ", ".join(f"{s}[.gz]" for s in STEMS)
    drop_en = "unset MPARLIB_DATA" if env else "leave out root="
    drop_ja = "MPARLIB_DATA を解除" if env else "root= を省略"
    raise DataNotFoundError(tr(
        f"Fashion-MNIST: {why}{folder} cannot be used: {detail_en}. A folder you name is used as it is or not at "
        f"all; no other copy was tried. Fix the name, or put the four files {names} there (plain or .gz, or in "
        f"its subfolder FashionMNIST/raw), or {drop_en} to let the course use its own copy or download one.",
        f"Fashion-MNIST: {why}{folder} は使えません。{detail_ja}。指定されたフォルダはそのまま使うか、使わないかの"
        "どちらかで、ほかのコピーは試していません。名前を直すか、4つのファイル "
        f"{names} をそこ（またはその下の FashionMNIST/raw）に置くか（.gz でも構いません）、{drop_ja}して"
        "コースの手元のコピーを使うかダウンロードさせてください。"))


def _named_folder(folder, why, env):
    """The folder the user named, if it holds all four files (itself or ``FashionMNIST/raw`` inside); else refuse."""
    if not folder.exists():
        near = difflib.get_close_matches(folder.name, os.listdir(folder.parent), n=1) \
            if folder.parent.is_dir() else []
        hint_en = f" (did you mean {folder.parent / near[0]}?)" if near else ""
        hint_ja = f"（{folder.parent / near[0]} のことでしょうか）" if near else ""
        _refuse_named(folder, why, env, f"it does not exist{hint_en}", f"このフォルダは存在しません{hint_ja}")
    if not folder.is_dir():
        _refuse_named(folder, why, env, "it is a file, not a folder", "これはフォルダではなくファイルです")
    layouts = [(f, *_inventory(f)) for f in (folder, folder / "FashionMNIST" / "raw")]
    used = [(f, found, odd, missing) for f, found, odd, missing in layouts if found or odd]
    if used and all(len(found) == 4 for _, found, _, _ in used):
        return used[0][0]  # the folder itself before its torchvision layout
    if not used:
        _refuse_named(folder, why, env, "it holds none of the four files", "4つのファイルが 1つもありません")
    parts = []
    for f, found, odd, missing in used:
        where = "" if f == folder else tr(f" (in {f.relative_to(folder)})", f"（{f.relative_to(folder)} の中）")
        count = tr("all 4 files are there", "4つのファイルがすべてあります") if len(found) == 4 else _count_note(found)
        parts.append(f"{count}{where}" + "".join(tr(f"; {p}", f"、{p}") for p in _problems(odd, missing)))
    if len(used) == 2:
        parts.append(tr("keep one set only, or name the complete folder itself",
                        "どちらか一方だけを残すか、そろっているほうのフォルダを直接指定してください"))
    text = tr("; ".join(parts), "。".join(parts))
    _refuse_named(folder, why, env, text, text)


def _default_places():
    places = []
    for folder, why in ((_cache_dir(), tr("user cache", "ユーザーのキャッシュ")),
                        (SYSTEM_DIR, tr("Debian package dataset-fashion-mnist", "Debian パッケージ dataset-fashion-mnist"))):
        places += [(folder, why),
                   (folder / "FashionMNIST" / "raw", why + tr(", torchvision layout", "、torchvision の配置"))]
    return places


def _as_folder(root, what):
    if isinstance(root, bool) or not isinstance(root, (str, PurePath)) and not hasattr(root, "__fspath__"):
        raise ConfigError(tr(f"{what}: root must be a folder name (a str or a pathlib.Path), got {type(root).__name__}.",
                             f"{what}: root にはフォルダ名（str か pathlib.Path）を渡してください。渡されたのは "
                             f"{type(root).__name__} です。"))
    return Path(root).expanduser()


def _find(root, download):
    """``(folder, why)``: where the four files are, and in words why that folder was chosen."""
    flag(download, "download", "load_fashion_mnist")
    env = os.environ.get("MPARLIB_DATA", "")
    if root is not None or env:
        why = "root=" if root is not None else "MPARLIB_DATA="
        folder = _named_folder(_as_folder(root if root is not None else env, "load_fashion_mnist"), why,
                               env=root is None)
        return folder, tr(f"the folder given as {why}", f"{why} で指定されたフォルダ")
    searched, skipped = [], []
    for folder, why in _default_places():
        found = _inventory(folder)[0]
        if len(found) == 4:
            note = why + "".join(tr(f"; skipped {s}", f"。{s} は飛ばしました") for s in skipped)
            return folder, note
        if found:
            skipped.append(tr(f"{folder} ({_count_note(found)})", f"{folder}（{_count_note(found)}）"))
        searched.append(f"{folder}  ({why}: {_count_note(found)})")
    target = _cache_dir()
    if download:
        try:
            _download(target)
            return target, tr("downloaded into the user cache from torchvision's mirror",
                              "torchvision のミラーからユーザーのキャッシュにダウンロードしました")
        except OSError as e:  # no network, mirror down, disk full, bad download: all end in the same advice
            searched.append(tr(f"download with torchvision's mirror list into {target}: failed ({e})",
                               f"torchvision のミラーから {target} へのダウンロード: 失敗（{e}）"))
    else:
        searched.append(tr("download: not tried (download=False)", "ダウンロード: 試していません（download=False）"))
    names = ", ".join(f"{s}[.gz]" for s in STEMS)
    raise DataNotFoundError(tr(
        "Fashion-MNIST was not found. Places searched, in order:\n  - " + "\n  - ".join(searched) +
        "\nGet the data in one of two ways:\n"
        f"  1. Offline: `sudo apt-get install dataset-fashion-mnist` (installs it in {SYSTEM_DIR}),\n"
        f"     or copy the files {names} into a folder and pass root=FOLDER or set MPARLIB_DATA=FOLDER.\n"
        "  2. Online: connect to the internet and call load_fashion_mnist() again; torchvision's mirror\n"
        f"     is then downloaded into {target}.",
        "Fashion-MNIST が見つかりません。探した場所（順に）:\n  - " + "\n  - ".join(searched) +
        "\nデータは次のどちらかの方法で用意してください:\n"
        f"  1. オフライン: `sudo apt-get install dataset-fashion-mnist` を実行する（{SYSTEM_DIR} に入ります）か、\n"
        f"     ファイル {names} をフォルダにコピーして root=FOLDER を渡すか MPARLIB_DATA=FOLDER を設定します。\n"
        "  2. オンライン: インターネットに接続して load_fashion_mnist() をもう一度呼びます。torchvision の\n"
        f"     ミラーから {target} にダウンロードします。"))


def locate(root=None, *, download=True, why=False):
    """The folder holding all four Fashion-MNIST files, downloading them if allowed. Explained in 07_performance.

    ``root`` (or, without it, ``$MPARLIB_DATA``) is used as it is, or refused with the reason (missing, a file,
    incomplete): never skipped. Without either, the user cache, then ``/usr/share/datasets/fashion-mnist`` (each
    also in torchvision's layout ``FOLDER/FashionMNIST/raw``), then a download into the user cache. The folder
    chosen and why are logged (logger ``mparlib.data``, level INFO); ``why=True`` also returns that sentence:
    ``(folder, sentence)``.
    """
    folder, reason = _find(root, download)
    sentence = tr(f"Fashion-MNIST: {folder} ({reason})", f"Fashion-MNIST: {folder}（{reason}）")
    log.info("%s", sentence)
    return (folder, sentence) if why else folder


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
                                 unit_scale=True, desc=name, disable=quiet()) as bar:
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
            raise OSError(tr(f"the downloaded files are not the original data set: {e}",
                             f"ダウンロードしたファイルが元のデータセットと一致しません: {e}")) from None
        finally:
            for key in [k for k in _PARSED if k[0].startswith(str(Path(tmp).resolve()))]:
                del _PARSED[key]  # forget the temporary copies
        for name, _md5 in FashionMNIST.resources:
            if not (target / name).exists():  # never overwrite a file that is already there
                os.replace(Path(tmp, name), target / name)
