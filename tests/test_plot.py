"""The Animator: one PNG updated in place inside a kernel, a PNG file outside one (chapter 00_setup)."""
import warnings

import nbformat
import pytest
from PIL import Image

from mparlib.plot import Animator


def test_outside_a_kernel_it_writes_a_png_and_prints_one_line_per_update(tmp_path, capsys):
    path = tmp_path / "curves.png"
    animator = Animator(xlabel="epoch", legend=["loss", "acc"], xlim=[1, 3], path=path)
    assert not animator.display
    for epoch in (1, 2, 3):
        animator.add(epoch, (1.0 / epoch, 0.5 + 0.1 * epoch))
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "x=3.0" in lines[-1] and "acc 0.800" in lines[-1] and str(path) in lines[-1]
    assert Image.open(path).format == "PNG"
    assert animator.Y == [[1.0, 0.5, 1.0 / 3], [0.6, 0.7, 0.8]]
    assert not list(tmp_path.glob(".*.tmp")), "the PNG is written through a temporary file and renamed"


def test_echo_false_writes_the_png_and_prints_nothing(tmp_path, capsys):
    path = tmp_path / "curves.png"
    animator = Animator(legend=["loss"], path=path, display=False, echo=False)
    animator.add(1, 0.5)
    assert capsys.readouterr().out == "" and Image.open(path).format == "PNG"


def test_the_number_of_values_must_match_the_curves(tmp_path):
    animator = Animator(path=tmp_path / "a.png")
    animator.add(1, (0.1, 0.2))
    with pytest.raises(ValueError, match="draws 2 curve"):
        animator.add(2, (0.1,))


def test_japanese_labels_render_without_missing_glyphs(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warns "Glyph ... missing from font(s)"
        animator = Animator(xlabel="エポック", ylabel="テスト精度", legend=["訓練損失", "テスト精度"],
                            title="データ並列の学習曲線", path=tmp_path / "ja.png")
        animator.add(1, (0.9, -0.5))


@pytest.mark.slow
def test_inside_a_kernel_it_shows_one_image_and_updates_it_in_place(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "from mparlib.plot import Animator\n"
        "a = Animator(legend=['loss'])\n"
        "print('before')\n"
        "for i in range(1, 4):\n"
        "    a.add(i, 1 / i)\n"
        "print('after', a.handle is not None)\n"
    )]
    updates = []
    client = NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    original = client.process_message

    def spy(msg, cell, cell_index):
        if msg["msg_type"] in ("display_data", "update_display_data"):
            updates.append(msg["msg_type"])
        return original(msg, cell, cell_index)

    client.process_message = spy
    client.execute()
    outputs = nb.cells[0].outputs
    images = [o for o in outputs if o.output_type == "display_data"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert updates == ["display_data", "update_display_data", "update_display_data"]
    assert len(images) == 1 and "image/png" in images[0].data and "image/svg+xml" not in images[0].data
    assert "before" in text and "after True" in text, "printed text in the same cell survives the updates"
    assert not (tmp_path / "animator.png").exists(), "inside a kernel no file is written unless asked"


def test_files_written_atomically_get_the_usual_permissions(tmp_path):
    import os

    from mparlib.files import atomic_write_bytes

    umask = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "a.bin", b"data")
    finally:
        os.umask(umask)
    assert (tmp_path / "a.bin").read_bytes() == b"data"
    assert (tmp_path / "a.bin").stat().st_mode & 0o777 == 0o644


def test_a_curve_with_a_single_point_is_still_visible(tmp_path):
    animator = Animator(legend=["test acc"], path=tmp_path / "one.png")
    animator.add(1, 0.5)
    (line,) = animator.ax.get_lines()
    assert line.get_marker() == "o"
    animator.add(2, 0.6)
    (line,) = animator.ax.get_lines()
    assert line.get_marker() in ("None", None, "")


def test_an_atomic_write_error_names_the_target_and_leaves_no_temporary_file(tmp_path):
    from mparlib.files import atomic_write_bytes

    (tmp_path / "a.png").mkdir()  # a folder where the file should go
    with pytest.raises(IsADirectoryError) as info:
        atomic_write_bytes(tmp_path / "a.png", b"data")
    assert info.value.filename == str(tmp_path / "a.png") and ".tmp" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png"] and (tmp_path / "a.png").is_dir()
