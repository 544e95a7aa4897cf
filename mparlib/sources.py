"""Where Fashion-MNIST comes from: a folder you name, the user cache, the Debian package, or a download.

A folder you name (``root=`` or ``$MPARLIB_DATA``) is used as it is or refused with the reason (missing, a file,
incomplete, a folder where a file should be); it is never skipped for another copy. Without one, the user cache
and then the Debian package's folder are searched (partial copies there are skipped and mentioned), and the last
resort is a download into the user cache. :mod:`mparlib.data` reads and checks what is found here.
Explained in 07_performance.
"""
import difflib
import http.client
import logging
import os
import tempfile
import urllib.request
from pathlib import Path, PurePath

from .errors import ConfigError, CorruptDataError, DataNotFoundError
from .lang import tr
from .progress import quiet

log = logging.getLogger("mparlib.data")

SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")  # installed by `apt-get install dataset-fashion-mnist`
FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
STEMS = FILES["train"] + FILES["test"]


def _cache_dir():
    """The user cache folder for downloads: ``$XDG_CACHE_HOME/mparlib/fashion-mnist`` (default ``~/.cache/...``)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # the XDG rule: relative values are ignored
    return base / "mparlib" / "fashion-mnist"


# ----------------------------------------------------------------------------------------------------------------
# Finding the files
# ----------------------------------------------------------------------------------------------------------------
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
        places += [(folder, why), (folder / "FashionMNIST" / "raw", why + tr(", torchvision layout", "、torchvision の配置"))]
    return places


def _as_folder(root, what):
    if isinstance(root, bool) or not isinstance(root, (str, PurePath)) and not hasattr(root, "__fspath__"):
        raise ConfigError(tr(f"{what}: root must be a folder name (a str or a pathlib.Path), got {type(root).__name__}.",
                             f"{what}: root にはフォルダ名（str か pathlib.Path）を渡してください。渡されたのは "
                             f"{type(root).__name__} です。"))
    return Path(root).expanduser()


def _find(root, download):
    """``(folder, why)``: where the four files are, and in words why that folder was chosen."""
    if not isinstance(download, bool):
        raise ConfigError(tr(f"download={download!r}; use True or False.",
                             f"download={download!r} です。True か False を指定してください。"))
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


def locate(root=None, *, download=True):
    """The folder holding all four Fashion-MNIST files, downloading them if allowed. Explained in 07_performance.

    ``root`` (or, without it, ``$MPARLIB_DATA``) is used as it is, or refused with the reason (missing, a file,
    incomplete): never skipped. Without either, the user cache, then ``/usr/share/datasets/fashion-mnist`` (each
    also in torchvision's layout ``FOLDER/FashionMNIST/raw``), then a download into the user cache. The folder
    chosen and why are logged (logger ``mparlib.data``, level INFO).
    """
    folder, why = _find(root, download)
    log.info("Fashion-MNIST: %s (%s)", folder, why)
    return folder


def _download(target):
    """Download the four .gz files from torchvision's mirror list, check them, then move them into ``target``."""
    from torchvision.datasets import FashionMNIST
    from tqdm.auto import tqdm

    from .data import _PARSED, read_split  # the reader checks the download as it checks any copy

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
