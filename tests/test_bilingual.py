"""The English and Japanese editions stay in step, and the notebooks match their sources."""
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EN, JA = ROOT / "notebooks" / "en", ROOT / "notebooks" / "ja"
NAMES = sorted({p.name for p in EN.glob("*.ipynb")} | {p.name for p in JA.glob("*.ipynb")})
JAPANESE = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff01-\uff5e]")
CODE = re.compile(r"```.*?```|`[^`]*`|\$\$.*?\$\$|\$[^$]*\$|<[^>]+>|\(http[^)]*\)", re.S)


def cells(path, kind):
    nb = json.loads(path.read_text(encoding="utf-8"))
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def test_there_are_notebooks():
    assert "00_setup.ipynb" in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_chapter_exists_in_both_languages(name):
    assert (EN / name).exists(), f"notebooks/en/{name} is missing"
    assert (JA / name).exists(), f"notebooks/ja/{name} is missing"


@pytest.mark.parametrize("name", NAMES)
def test_code_cells_are_identical_and_in_the_same_order(name):
    assert cells(EN / name, "code") == cells(JA / name, "code")


@pytest.mark.parametrize("name", NAMES)
def test_markdown_cell_counts_match(name):
    assert len(cells(EN / name, "markdown")) == len(cells(JA / name, "markdown"))


def japanese_share(text):
    prose = CODE.sub("", text)
    letters = [ch for ch in prose if ch.isalpha()]
    return sum(bool(JAPANESE.match(ch)) for ch in letters) / max(1, len(letters))


@pytest.mark.parametrize("name", NAMES)
def test_japanese_markdown_is_mostly_japanese(name):
    for text in cells(JA / name, "markdown"):
        if len(CODE.sub("", text).strip()) > 20:
            assert japanese_share(text) > 0.5, f"ja/{name}: this cell reads as English:\n{text[:200]}"


@pytest.mark.parametrize("name", NAMES)
def test_japanese_prose_follows_the_glossary_style(name):
    for text in cells(JA / name, "markdown"):
        prose = CODE.sub("", text)
        assert "，" not in prose and "．" not in prose, f"ja/{name}: use 、 and 。 (GLOSSARY.md)"
        assert "グラデーション" not in prose, f"ja/{name}: gradient is 勾配 (GLOSSARY.md)"
        spaced = re.search(r"\d (つ|枚|個|回|行|章|倍|件)", prose)
        assert not spaced, f"ja/{name}: no space between a number and its counter ({spaced and spaced.group()!r})"
        assert "である。" not in prose, f"ja/{name}: write in です・ます調, not である調"
        body = "\n".join(line for line in prose.splitlines() if not line.lstrip().startswith(("#", "|", "-", "*")))
        if len(JAPANESE.findall(body)) > 80:
            assert re.search("(です|ます|ません|でした|ました|しょう|ください|でしょうか)[。？]", body), f"ja/{name}: です・ます調 expected"


def test_stored_notebooks_are_in_step_with_their_sources():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import notebooks as builder
    finally:
        sys.path.pop(0)
    problems = builder.check(builder.chapters())
    assert not problems, "\n".join(problems)
    stems = {Path(n).stem for n in NAMES}
    assert stems == set(builder.chapters()), "every notebook has a source in notebooks/src and vice versa"


@pytest.mark.parametrize("name", NAMES)
def test_notebooks_are_stored_executed(name):
    for folder in (EN, JA):
        nb = json.loads((folder / name).read_text(encoding="utf-8"))
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and "".join(cell["source"]).strip():
                assert cell["execution_count"] is not None, f"{folder.name}/{name}: a code cell was not executed"
