"""Tests of mparlib.sources and mparlib.data: the IDX reader and its errors on small files written here, the look-up
order, the download path (from a local mirror), the two iterators against each other, and the real data set when
installed."""
import gzip
import hashlib
import os
from pathlib import Path

import pytest
import torch

from mparlib import data, sources
from mparlib.errors import ConfigError, CorruptDataError, DataNotFoundError, DeviceError

REAL = sources.SYSTEM_DIR
HAVE_REAL = all((REAL / (s + ".gz")).is_file() or (REAL / s).is_file() for s in sources.FILES["train"] + sources.FILES["test"])
needs_real = pytest.mark.skipif(not HAVE_REAL, reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)")


def idx_bytes(array, magic=None):
    """Encode a uint8 tensor as IDX: magic (0x0800 + ndim), big-endian dims, then the bytes."""
    magic = 0x0800 + array.dim() if magic is None else magic
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return magic.to_bytes(4, "big") + dims + array.contiguous().numpy().tobytes()


def write(path, raw, gz=False):
    path = Path(str(path) + (".gz" if gz else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(raw) if gz else raw)
    return path


def make_set(folder, n_train=40, n_test=12, gz=False, seed=0):
    """Write a small random Fashion-MNIST-shaped set; return {stem: (tensor, path)}."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        img_stem, lab_stem = sources.FILES[split]
        images = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        labels = torch.randint(0, 10, (n,), dtype=torch.uint8, generator=g)
        out[img_stem] = (images, write(Path(folder) / img_stem, idx_bytes(images), gz))
        out[lab_stem] = (labels, write(Path(folder) / lab_stem, idx_bytes(labels), gz))
    return out


def snapshot(folder):
    return {p: p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """No system data, an empty user cache, no $MPARLIB_DATA, and a torchvision mirror that is an empty local folder."""
    monkeypatch.setattr(sources, "SYSTEM_DIR", tmp_path / "system")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("MPARLIB_DATA", raising=False)
    from torchvision.datasets import FashionMNIST
    (tmp_path / "mirror").mkdir()
    monkeypatch.setattr(FashionMNIST, "mirrors", [(tmp_path / "mirror").as_uri() + "/"])
    return tmp_path


def cache_dir():
    """The user cache as the XDG rule makes it (the offline fixture sets XDG_CACHE_HOME)."""
    return Path(os.environ["XDG_CACHE_HOME"]) / "mparlib" / "fashion-mnist"


def epoch(it):
    xs, ys = zip(*list(it))
    return torch.cat(xs), torch.cat(ys)


# ---------------------------------------------------------------- reader


@pytest.mark.parametrize("gz", [False, True])
def test_read_split_round_trip_and_checksum_of_content(offline, monkeypatch, gz):
    files = make_set(offline / "d", gz=gz)
    images, labels = sources.read_split(offline / "d", "train", verify=False)
    assert torch.equal(images, files["train-images-idx3-ubyte"][0]) and images.dtype == torch.uint8
    assert torch.equal(labels, files["train-labels-idx1-ubyte"][0].long()) and labels.dtype == torch.int64
    # verified against the sha256 of the decompressed content, not of the .gz bytes
    monkeypatch.setattr(sources, "COUNTS", {"train": 40, "test": 12})
    monkeypatch.setattr(sources, "SHA256", {stem: hashlib.sha256(idx_bytes(t)).hexdigest()
                                            for stem, (t, _) in files.items()})
    sources.read_split(offline / "d", "train", verify=True)


@pytest.mark.parametrize("gz", [False, True])
def test_small_set_loads_with_verify_false(offline, gz):
    files = make_set(offline / "mine", gz=gz)
    train, test = data.load_fashion_mnist(16, root=offline / "mine", verify=False, num_workers=0)
    for it, split in ((train, "train"), (test, "test")):
        x, y = epoch(it)
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape[1:] == (1, 28, 28)
        assert 0 <= x.min() and x.max() <= 1
    x, y = epoch(test)  # test set in file order, ToTensor semantics
    img, lab = files["t10k-images-idx3-ubyte"][0], files["t10k-labels-idx1-ubyte"][0]
    assert torch.equal(y, lab.long()) and torch.equal(x[:, 0], img.float() / 255)


def test_real_checksums_are_refused_for_other_content(offline):
    make_set(offline / "mine")
    with pytest.raises(CorruptDataError, match="holds 40 examples; the train set has 60000.*verify=False"):
        data.load_fashion_mnist(16, root=offline / "mine")


def check_error(folder, path, match, **kw):
    """Loading fails naming `path`, and no file under `folder` is changed or deleted."""
    before = snapshot(folder)
    with pytest.raises(CorruptDataError, match=match) as e:
        data.load_fashion_mnist(8, root=folder, num_workers=0, **kw)
    assert str(path) in str(e.value) and "left unchanged" in str(e.value)
    assert snapshot(folder) == before
    return str(e.value)


@pytest.mark.parametrize("gz", [False, True])
def test_bad_magic(offline, gz):
    files = make_set(offline / "d", gz=gz)
    images, path = files["train-images-idx3-ubyte"]
    write(offline / "d" / "train-images-idx3-ubyte", idx_bytes(images, magic=0x0801), gz)
    check_error(offline / "d", path, "magic number 0x00000803", verify=False)


@pytest.mark.parametrize("gz", [False, True])
def test_truncated_file(offline, gz):
    files = make_set(offline / "d", gz=gz)
    path = files["t10k-images-idx3-ubyte"][1]
    path.write_bytes(path.read_bytes()[:-100])  # a cut-off download
    check_error(offline / "d", path, "decompress" if gz else "is truncated", verify=False)


def test_header_cut_and_extra_bytes(offline):
    files = make_set(offline / "d")
    path = files["train-labels-idx1-ubyte"][1]
    path.write_bytes(path.read_bytes()[:6])
    check_error(offline / "d", path, "end inside the IDX header", verify=False)
    path.write_bytes(idx_bytes(files["train-labels-idx1-ubyte"][0]) + b"\0")
    check_error(offline / "d", path, "extra bytes at the end", verify=False)


def test_a_gzip_bomb_is_refused_without_inflating_it(offline):
    import tracemalloc

    files = make_set(offline / "d", gz=True)
    labels, path = files["train-labels-idx1-ubyte"]
    with gzip.open(path, "wb", compresslevel=1) as f:  # a true header, then 200 MB of zeros (200 kB on disk)
        f.write(idx_bytes(labels))
        for _ in range(200):
            f.write(bytes(1 << 20))
    tracemalloc.start()
    try:
        message = check_error(offline / "d", path, "decompression was stopped there", verify=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "zip bomb" in message and peak < 50 << 20  # far less than the 200 MB it would inflate to


def test_a_header_announcing_gigabytes_is_refused_before_decompressing(offline):
    files = make_set(offline / "d", gz=True)
    path = files["train-images-idx3-ubyte"][1]
    header = (0x0803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (60000, 4096, 4096))
    write(offline / "d" / "train-images-idx3-ubyte", header + bytes(1000), gz=True)
    check_error(offline / "d", path, r"announces 1006632960016 bytes of data .* it was not decompressed", verify=False)


def test_wrong_image_size(offline):
    files = make_set(offline / "d")
    path = write(offline / "d" / "train-images-idx3-ubyte", idx_bytes(torch.zeros(40, 32, 32, dtype=torch.uint8)))
    check_error(offline / "d", path, "32x32 images; Fashion-MNIST's are 28x28", verify=False)


def test_label_out_of_range_and_count_mismatch(offline):
    files = make_set(offline / "d")
    labels, path = files["t10k-labels-idx1-ubyte"]
    write(path, idx_bytes(torch.cat([labels[:-1], torch.tensor([10], dtype=torch.uint8)])))
    check_error(offline / "d", path, "label 10; labels are the classes 0-9", verify=False)
    write(path, idx_bytes(labels[:-1]))
    check_error(offline / "d", path, "holds 11 labels but t10k-images-idx3-ubyte holds 12 images", verify=False)


def test_checksum_mismatch_on_verified_path(offline, monkeypatch):
    files = make_set(offline / "d")
    monkeypatch.setattr(sources, "COUNTS", {"train": 40, "test": 12})  # right counts, so only the content differs
    path = files["train-images-idx3-ubyte"][1]
    msg = check_error(offline / "d", path, "differs from the original Fashion-MNIST")
    assert sources.SHA256["train-images-idx3-ubyte"] in msg and "verify=False" in msg


def test_fix_advice_depends_on_where_the_file_is(offline):
    files = make_set(sources.SYSTEM_DIR)
    path = files["train-labels-idx1-ubyte"][1]
    path.write_bytes(b"garbage")
    before = snapshot(sources.SYSTEM_DIR)
    with pytest.raises(CorruptDataError, match="apt-get install --reinstall dataset-fashion-mnist"):
        data.load_fashion_mnist(8, verify=False)
    assert snapshot(sources.SYSTEM_DIR) == before
    files = make_set(cache_dir())
    files["train-labels-idx1-ubyte"][1].write_bytes(b"garbage")
    with pytest.raises(CorruptDataError, match="delete or rename it"):
        data.load_fashion_mnist(8, verify=False)


# ---------------------------------------------------------------- look-up and download


def test_missing_everywhere_lists_every_place_and_both_remedies(offline):
    make_set(cache_dir())
    (cache_dir() / "t10k-labels-idx1-ubyte").unlink()  # a partial copy: skipped by the default look-up
    with pytest.raises(DataNotFoundError) as e:
        data.load_fashion_mnist(8)
    msg = str(e.value)
    for folder in (cache_dir(), sources.SYSTEM_DIR):
        assert f"{folder}  (" in msg and f"{folder / 'FashionMNIST' / 'raw'}  (" in msg
    assert "found 3 of the 4 files" in msg and "download with torchvision's mirror list" in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "MPARLIB_DATA" in msg and "Online" in msg
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted(sources.STEMS[:3])  # nothing added


def test_lookup_order(offline, monkeypatch):
    sys_files = make_set(sources.SYSTEM_DIR, seed=1)
    first = lambda **kw: epoch(data.load_fashion_mnist(100, verify=False, **kw)[1])[1]
    assert torch.equal(first(), sys_files["t10k-labels-idx1-ubyte"][0].long())
    cache_files = make_set(cache_dir() / "FashionMNIST" / "raw", seed=2, gz=True)  # torchvision layout
    assert torch.equal(first(), cache_files["t10k-labels-idx1-ubyte"][0].long())
    env_files = make_set(offline / "env", seed=3)
    monkeypatch.setenv("MPARLIB_DATA", str(offline / "env"))
    assert torch.equal(first(), env_files["t10k-labels-idx1-ubyte"][0].long())
    root_files = make_set(offline / "root", seed=4)
    assert torch.equal(first(root=offline / "root"), root_files["t10k-labels-idx1-ubyte"][0].long())


def test_download_goes_to_cache_through_temp_names(offline, monkeypatch):
    files = make_set(offline / "mirror", gz=True)  # the local "mirror" serves .gz files as the real one does
    monkeypatch.setattr(sources, "COUNTS", {"train": 40, "test": 12})
    sha = {s: hashlib.sha256(idx_bytes(t)).hexdigest() for s, (t, _) in files.items()}
    monkeypatch.setattr(sources, "SHA256", sha)
    # a file the user already has in the cache (same content, compressed differently) must not be overwritten
    mine = cache_dir() / "train-labels-idx1-ubyte.gz"
    mine.parent.mkdir(parents=True)
    mine.write_bytes(gzip.compress(idx_bytes(files["train-labels-idx1-ubyte"][0]), compresslevel=1, mtime=0))
    before = mine.read_bytes()
    train, test = data.load_fashion_mnist(8, num_workers=0)
    assert mine.read_bytes() == before
    assert sorted(p.name for p in cache_dir().iterdir()) == sorted(s + ".gz" for s in files)  # no temp left
    assert torch.equal(epoch(test)[1], files["t10k-labels-idx1-ubyte"][0].long())
    for p in (offline / "mirror").iterdir():
        p.unlink()
    data.load_fashion_mnist(8)  # served from the cache now, no network needed


def test_download_of_wrong_content_is_not_kept(offline):
    make_set(offline / "mirror", gz=True)  # well-formed, but not Fashion-MNIST
    with pytest.raises(DataNotFoundError, match="not the original data set"):
        data.load_fashion_mnist(8)
    assert not list(cache_dir().iterdir())


# ---------------------------------------------------------------- iterators


@pytest.fixture
def small(offline):
    return make_set(offline / "d", n_train=45, n_test=13)


def load(offline, **kw):
    return data.load_fashion_mnist(kw.pop("batch_size", 8), root=offline / "d", verify=False, num_workers=0, **kw)


def test_classic_and_resident_give_the_same_batches(offline, small):
    classic = load(offline, resident=False, shuffle_seed=5)
    resident = load(offline, resident=True, shuffle_seed=5)
    assert isinstance(classic[0], torch.utils.data.DataLoader) and isinstance(resident[0], data.ResidentLoader)
    for c, r in zip(classic, resident):
        assert len(c) == len(r)
        for _ in range(2):  # two epochs: same order both times
            for (xc, yc), (xr, yr) in zip(c, r):
                assert xc.shape == xr.shape and xc.dtype == xr.dtype == torch.float32
                assert torch.equal(xc, xr) and torch.equal(yc, yr) and yr.dtype == torch.int64


def test_each_epoch_is_a_new_permutation_of_the_whole_set(offline, small):
    train, test = load(offline, resident=True)
    images = small["train-images-idx3-ubyte"][0]
    rows = sorted(map(bytes, images.reshape(45, -1).numpy()))
    orders = []
    for _ in range(3):
        x, y = epoch(train)
        assert [len(b) for b, _ in train] == [8] * 5 + [5]  # last partial batch kept
        assert sorted(map(bytes, (x * 255).round().to(torch.uint8).reshape(45, -1).numpy())) == rows
        orders.append(y)
    assert not torch.equal(orders[0], orders[1]) or not torch.equal(orders[1], orders[2])
    assert torch.equal(epoch(test)[1], epoch(test)[1])  # test set: file order every time
    again = load(offline, resident=True)[0]
    assert torch.equal(epoch(again)[1], orders[0])  # same seed, same first epoch


def test_classic_iterator_reshuffles_each_epoch(offline, small):
    train, _ = load(offline, resident=False, shuffle_seed=None)
    a, b = epoch(train)[1], epoch(train)[1]
    assert sorted(a.tolist()) == sorted(b.tolist()) == sorted(small["train-labels-idx1-ubyte"][0].tolist())
    assert len(a) == 45


@pytest.mark.parametrize("resize", [32, (20, 36)])
def test_resize_matches_between_iterators(offline, small, resize):
    (c, _), (r, _) = load(offline, resize=resize, resident=False), load(offline, resize=resize, resident=True)
    hw = (resize, resize) if isinstance(resize, int) else resize
    for (xc, yc), (xr, yr) in zip(c, r):
        assert xc.shape[1:] == xr.shape[1:] == (1, *hw)
        torch.testing.assert_close(xc, xr, rtol=0, atol=1e-6)
        assert torch.equal(yc, yr)


def test_subset_sizes(offline, small):
    assert [len(it.dataset) for it in load(offline, subset=30)] == [30, 5]
    train, test = load(offline, subset=(20, 3), resident=True)
    assert len(train.dataset) == 20 and torch.equal(epoch(test)[1], small["t10k-labels-idx1-ubyte"][0][:3].long())
    for bad in (0, -1, (5,), (5, 0), True, 2.5):
        with pytest.raises(ValueError, match="subset="):
            load(offline, subset=bad)
    with pytest.raises(ValueError, match="asks for 46 training examples"):
        load(offline, subset=(46, 1))


def test_bad_arguments(offline, small):
    for kw in ({"batch_size": 0}, {"resize": 0}, {"resize": (28,)}, {"resize": 2.5}):
        with pytest.raises(ValueError):
            load(offline, **kw)


def test_device_argument(offline, small):
    train, test = load(offline, device="cpu")
    assert isinstance(train, data.ResidentLoader) and train.images.device.type == "cpu"
    train, _ = load(offline, device="cpu", resident=False)
    x, y = next(iter(train))
    assert len(train) == 6 and x.device.type == "cpu" and len(train.dataset) == 45


def test_worker_processes(offline, small):
    train, _ = data.load_fashion_mnist(8, root=offline / "d", verify=False, num_workers=1, resident=False)
    ref, _ = load(offline, resident=True)
    assert torch.equal(epoch(train)[0], epoch(ref)[0])


@pytest.mark.gpu
def test_resident_on_gpu_matches_classic(offline, small):
    classic = load(offline, resident=False, resize=40)[0]
    gpu = load(offline, device="cuda:0", resize=40)[0]
    for (xc, yc), (xg, yg) in zip(classic, gpu):
        assert xg.device.type == "cuda" and torch.equal(yc, yg.cpu())
        torch.testing.assert_close(xc, xg.cpu(), rtol=0, atol=1e-5)


def test_text_labels(monkeypatch):
    assert data.text_labels([0, 9], lang="en") == ["T-shirt/top", "Ankle boot"]
    assert data.text_labels(torch.tensor([0, 1, 9]), lang="ja") == ["Tシャツ/トップス", "ズボン", "アンクルブーツ"]
    assert data.text_labels(7, lang="ja") == "スニーカー"
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    assert data.text_labels([8]) == ["バッグ"]
    monkeypatch.setenv("MPARLIB_LANG", "en")
    assert data.text_labels([8]) == ["Bag"]
    assert len(set(data.TEXT_LABELS["en"])) == len(set(data.TEXT_LABELS["ja"])) == 10
    with pytest.raises(ValueError, match="lang="):
        data.text_labels([0], lang="fr")


# ---------------------------------------------------------------- the real data set


@needs_real
@pytest.mark.parametrize("split", ["train", "test"])
def test_real_data_counts_checksums_and_classes(split):
    images, labels = sources.read_split(REAL, split, verify=True)
    n = sources.COUNTS[split]
    assert images.shape == (n, 28, 28) and images.dtype == torch.uint8 and labels.dtype == torch.int64
    assert torch.bincount(labels, minlength=10).tolist() == [n // 10] * 10  # Fashion-MNIST is balanced
    for stem in sources.FILES[split]:
        path = next(REAL.glob(stem + "*"))
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        assert hashlib.sha256(raw).hexdigest() == sources.SHA256[stem]


@needs_real
def test_real_data_with_one_changed_label_is_refused(tmp_path):
    for stem in sources.FILES["train"] + sources.FILES["test"]:
        src = next(REAL.glob(stem + "*"))
        os.symlink(src, tmp_path / src.name)
    path = tmp_path / "train-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(path.read_bytes()))
    raw[8] = (raw[8] + 1) % 10  # one label changed: format, count and range still fine
    path.unlink()  # our symlink, not the real file
    path.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(CorruptDataError, match="differs from the original Fashion-MNIST") as e:
        sources.read_split(tmp_path, "train", verify=True)
    assert str(path) in str(e.value)
    sources.read_split(tmp_path, "train", verify=False)  # accepted when asked for


@needs_real
def test_real_iterators_agree():
    classic = data.load_fashion_mnist(500, root=REAL, subset=(2000, 1000), resident=False, num_workers=0)
    resident = data.load_fashion_mnist(500, root=REAL, subset=(2000, 1000), resident=True)
    for c, r in zip(classic, resident):
        xc, yc = epoch(c)
        xr, yr = epoch(r)
        assert torch.equal(xc, xr) and torch.equal(yc, yr)


# ---------------------------------------------------------------- a folder you name is used or refused


def refused(match, **kw):
    with pytest.raises(DataNotFoundError, match=match) as e:
        data.load_fashion_mnist(8, verify=False, num_workers=0, **kw)
    assert "no other copy was tried" in str(e.value)
    return str(e.value)


@pytest.fixture
def system_copy(offline):
    """A complete copy in the default place, so that any fall-through would succeed and show."""
    return make_set(sources.SYSTEM_DIR, n_train=60, n_test=10, seed=9)


def test_a_missing_or_mistyped_root_is_refused_with_a_suggestion(offline, system_copy):
    make_set(offline / "fashion-mnist")
    msg = refused("does not exist", root=offline / "fashion-mnsit")
    assert f"did you mean {offline / 'fashion-mnist'}?" in msg
    refused("is a file, not a folder", root=offline / "fashion-mnist" / "train-images-idx3-ubyte")
    (offline / "empty").mkdir()
    refused("holds none of the four files", root=offline / "empty")


@pytest.mark.parametrize("via", ["root", "MPARLIB_DATA"])
def test_an_incomplete_named_folder_is_refused_not_skipped(offline, system_copy, monkeypatch, via):
    make_set(offline / "mine", n_train=100, n_test=20)
    (offline / "mine" / "t10k-labels-idx1-ubyte").unlink()
    kw = {"root": offline / "mine"}
    if via == "MPARLIB_DATA":
        monkeypatch.setenv("MPARLIB_DATA", str(offline / "mine"))
        kw = {}
    msg = refused(r"found 3 of the 4 files; t10k-labels-idx1-ubyte\[.gz\] is missing", **kw)
    assert ("unset MPARLIB_DATA" if via == "MPARLIB_DATA" else "leave out root=") in msg
    assert str(sources.SYSTEM_DIR) not in msg


def test_a_folder_where_a_data_file_should_be_is_named(offline, system_copy):
    make_set(offline / "mine")
    (offline / "mine" / "train-labels-idx1-ubyte").unlink()
    (offline / "mine" / "train-labels-idx1-ubyte").mkdir()
    refused("train-labels-idx1-ubyte is a folder, not a file", root=offline / "mine")
    (offline / "mine" / "train-labels-idx1-ubyte").rmdir()
    os.symlink(offline / "gone", offline / "mine" / "train-labels-idx1-ubyte.gz")
    refused(r"train-labels-idx1-ubyte.gz is a link to nothing", root=offline / "mine")


def test_two_sets_in_one_named_folder_are_ambiguous(offline, system_copy):
    make_set(offline / "mine" / "FashionMNIST" / "raw")
    make_set(offline / "mine")
    (offline / "mine" / "t10k-images-idx3-ubyte").unlink()
    refused("all 4 files are there .in FashionMNIST/raw.*keep one set only", root=offline / "mine")


def test_verify_false_with_ones_own_file_missing_never_trains_on_the_system_copy(offline, system_copy):
    mine = make_set(offline / "mine", n_train=100, n_test=20)
    train, _ = data.load_fashion_mnist(10, root=offline / "mine", verify=False, resident=True)
    assert len(train.dataset) == 100 and torch.equal(train.labels, mine["train-labels-idx1-ubyte"][0].long())
    (offline / "mine" / "train-images-idx3-ubyte").unlink()
    refused("train-images-idx3-ubyte", root=offline / "mine")


def test_the_torchvision_layout_inside_a_named_folder_is_used(offline, system_copy):
    mine = make_set(offline / "mine" / "FashionMNIST" / "raw", n_train=30, n_test=6, gz=True)
    train, test = data.load_fashion_mnist(10, root=offline / "mine", verify=False, resident=True)
    assert torch.equal(test.labels, mine["t10k-labels-idx1-ubyte"][0].long())
    assert train.dataset.root == offline / "mine" / "FashionMNIST" / "raw"


def test_the_default_look_up_says_which_copy_it_used_and_what_it_skipped(offline, system_copy, caplog):
    make_set(cache_dir())
    (cache_dir() / "train-images-idx3-ubyte").unlink()  # a broken download in the cache
    with caplog.at_level("INFO", logger="mparlib.data"):
        train, test = data.load_fashion_mnist(10, verify=False, num_workers=0)
    for it in (train, test):
        assert it.dataset.root == sources.SYSTEM_DIR
        assert it.dataset.source.startswith(f"Fashion-MNIST: {sources.SYSTEM_DIR} (Debian package dataset-fashion-mnist")
        assert f"skipped {cache_dir()} (found 3 of the 4 files)" in it.dataset.source
    assert train.dataset.source in caplog.text
    assert sources.locate() == sources.SYSTEM_DIR
    named = data.load_fashion_mnist(10, root=sources.SYSTEM_DIR, verify=False, resident=True)[0]
    assert named.dataset.source == f"Fashion-MNIST: {sources.SYSTEM_DIR} (the folder given as root=)"


def test_the_download_is_never_used_instead_of_a_named_folder(offline):
    make_set(offline / "mirror", gz=True)
    (offline / "mine").mkdir()
    refused("holds none of the four files", root=offline / "mine")
    assert not cache_dir().exists()


# ---------------------------------------------------------------- no shared state between loads


def test_an_in_place_edit_of_a_loaded_tensor_does_not_change_the_next_load(offline, small):
    first, first_test = load(offline, resident=True)
    first.images.zero_()  # in place: the cache must have handed out a copy
    first.labels.fill_(3)
    images, labels = sources.read_split(offline / "d", "train", verify=False)
    images.fill_(7)
    again, _ = load(offline, resident=True)
    assert torch.equal(again.images, small["train-images-idx3-ubyte"][0])
    assert torch.equal(again.labels, small["train-labels-idx1-ubyte"][0].long())
    assert sources.read_split(offline / "d", "train", verify=False)[0].data_ptr() != again.images.data_ptr()


# ---------------------------------------------------------------- bad arguments, refused at once


def test_a_device_that_does_not_exist_is_refused_before_any_batch(offline, small):
    missing = f"cuda:{torch.cuda.device_count() + 3}"
    for resident in (False, True, None):
        with pytest.raises(DeviceError, match=f"device={missing} does not exist"):
            load(offline, device=missing, resident=resident)
        with pytest.raises(DeviceError, match="device='tpu' is not a device"):
            load(offline, device="tpu", resident=resident)


@pytest.mark.parametrize("kw, match", [
    ({"resize": True}, "resize=True"),
    ({"resize": (28, False)}, r"resize=\(28, False\)"),
    ({"batch_size": True}, "batch_size=True"),
    ({"batch_size": 2.0}, "batch_size=2.0"),
    ({"shuffle_seed": 1.5}, "shuffle_seed=1.5"),
    ({"shuffle_seed": 2**64}, "shuffle_seed="),
    ({"num_workers": -1}, "num_workers=-1"),
    ({"num_workers": 2, "resident": True}, "num_workers=2 applies to the classic iterator"),
    ({"resident": "yes"}, "resident='yes'"),
    ({"verify": "no"}, "verify='no'"),
    ({"download": 1}, "download=1"),
    ({"root": 3}, "root must be a folder name"),
])
def test_bad_arguments_are_refused_before_reading(offline, small, kw, match):
    with pytest.raises(ConfigError, match=match):
        data.load_fashion_mnist(kw.pop("batch_size", 8), **{"root": offline / "d", **kw})


def test_text_labels_refuse_what_is_not_a_class_index():
    import numpy as np

    assert data.text_labels(np.array([1, 2]), lang="en") == ["Trouser", "Pullover"]
    assert data.text_labels(torch.tensor(4), lang="en") == "Coat"
    for bad in (10, -1, 2.0, True, "3", [0, 11], None):
        with pytest.raises(ConfigError, match="is not a class index"):
            data.text_labels(bad, lang="en")


def test_to_float_and_read_split_refuse_wrong_inputs(offline, small):
    for bad in (torch.rand(2, 28, 28), torch.zeros(2, 1, 28, 28, dtype=torch.uint8), [[0]]):
        with pytest.raises(ConfigError, match=r"uint8 images of shape \(B, H, W\)"):
            data.to_float(bad)
    with pytest.raises(ConfigError, match="resize=True"):
        data.to_float(torch.zeros(2, 28, 28, dtype=torch.uint8), resize=True)
    with pytest.raises(ConfigError, match="split='val': use one of 'train', 'test'"):
        sources.read_split(offline / "d", "val")
    with pytest.raises(DataNotFoundError, match=r"lacks the train split: train-images-idx3-ubyte\[.gz\] is "
                                                     "missing; train-labels-idx1-ubyte"):
        sources.read_split(offline / "nowhere", "train")
    (offline / "d" / "t10k-images-idx3-ubyte").unlink()
    (offline / "d" / "t10k-images-idx3-ubyte").mkdir()
    with pytest.raises(DataNotFoundError, match="t10k-images-idx3-ubyte is a folder, not a file"):
        sources.read_split(offline / "d", "test")


def test_the_iterators_refuse_mismatched_tensors():
    images, labels = torch.zeros(4, 28, 28, dtype=torch.uint8), torch.zeros(4, dtype=torch.long)
    for args in ((images, labels[:3]), (images.float(), labels), (images, labels.float())):
        for build in (lambda i, l: data.ResidentLoader(i, l, 2, shuffle=False), data.FashionMNIST):
            with pytest.raises(ConfigError, match="uint8 images"):
                build(*args)
    with pytest.raises(ConfigError, match="batch_size=0"):
        data.ResidentLoader(images, labels, 0, shuffle=False)
    with pytest.raises(ConfigError, match="shuffle='yes': use True or False"):
        data.ResidentLoader(images, labels, 2, shuffle="yes")
    with pytest.raises(DeviceError, match="'tpu' is not a device"):
        data.ResidentLoader(images, labels, 2, shuffle=False, device="tpu")


def test_look_up_errors_speak_japanese_in_the_japanese_edition(offline, monkeypatch):
    make_set(offline / "mine")
    (offline / "mine" / "t10k-labels-idx1-ubyte").unlink()
    monkeypatch.setenv("MPARLIB_LANG", "ja")
    with pytest.raises(DataNotFoundError, match=r"root=.*mine は使えません。4つのファイルのうち 3個だけがあります、"
                                                     r"t10k-labels-idx1-ubyte\[.gz\] がありません。.*ほかのコピーは試していません"):
        data.load_fashion_mnist(8, root=offline / "mine", verify=False)
    with pytest.raises(ConfigError, match="resize=True は使えません"):
        data.load_fashion_mnist(8, resize=True)
