"""The English and Japanese editions stay in step, and the notebooks match their sources.

Besides the structure (same cells, same headings), this file checks the mechanical part of the Japanese writing
rules in notebooks/GLOSSARY.md, in the Japanese notebooks' prose, in the Japanese strings of ``tr(en, ja)`` in the
chapter sources and in ``mparlib``, and in what the Japanese notebooks print. Each rule is a small function that
returns the problems it finds; ``test_rule_*`` feeds it good and bad examples, so that a rule that stops catching
anything fails too.
"""
import ast
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


# --- Headings ----------------------------------------------------------------------------------------------------
# A heading missing from one edition makes its table of contents (and the book's sidebar) shorter than the other's.

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
HEADING = re.compile(r"^(#{1,6})[ \t]+\S.*$", re.M)


def headings(markdown):
    """The headings of one markdown cell as ``(level, text)``, in order; lines inside code fences do not count."""
    return [(len(m.group(1)), m.group(0).lstrip("#").strip()) for m in HEADING.finditer(FENCE.sub("", markdown))]


def heading_problems(en, ja):
    """Why two editions' markdown cells (lists of sources) differ in heading structure; [] when they agree."""
    problems = []
    for i, (a, b) in enumerate(zip(en, ja)):
        levels_en, levels_ja = [n for n, _ in headings(a)], [n for n, _ in headings(b)]
        if levels_en != levels_ja:
            shown = "; ".join("#" * n + " " + t for n, t in headings(a)) or "none"
            problems.append(f"markdown cell {i}: heading levels {levels_en} in English ({shown}) but {levels_ja} "
                            "in Japanese; give the Japanese part the same headings")
    return problems


def test_rule_headings():
    cell = "# Title\n\ntext\n\n## Part\n\n```python\n# a comment, not a heading\n```\n### Detail"
    assert [n for n, _ in headings(cell)] == [1, 2, 3]
    assert heading_problems([cell], ["# 題\n\n## 部\n\n### 細部"]) == []
    assert heading_problems(["## A\n\ntext"], ["本文だけ"]), "a missing heading is found"
    assert heading_problems(["## A"], ["### あ"]), "a heading of another level is found"
    assert heading_problems(["## A\n## B"], ["## あ\n\n## い\n\n## う"]), "an extra heading is found"


@pytest.mark.parametrize("name", NAMES)
def test_both_editions_have_the_same_headings_in_each_markdown_cell(name):
    problems = heading_problems(cells(EN / name, "markdown"), cells(JA / name, "markdown"))
    assert not problems, f"{name}:\n" + "\n".join(problems)


# --- The Japanese writing rules of GLOSSARY.md --------------------------------------------------------------------

JA_CHARS = "\u3040-\u309f\u30a0-\u30fa\u30fc-\u30ff\u3005\u3400-\u4dbf\u4e00-\u9fff"  # kana and kanji; not 、。・「」（）
JA_LETTER = re.compile(f"[{JA_CHARS}]")
SLOT = "\ue000"  # stands for a {...} of an f-string: a number or a name, so neither Japanese nor Latin
# Counters are written right after their number: 「18枚」「5エポック」「3回」「2017年」.
COUNTERS = ("つ", "枚", "個", "回", "章", "行", "本", "台", "件", "倍", "段", "列", "年", "秒", "点", "層", "通り", "次元",
            "種類", "文字", "番目", "クラス", "ビット", "バイト", "エポック", "ステップ")
COUNTER = "(?:" + "|".join(COUNTERS) + ")"
SPACED_COUNTER = re.compile(rf"(?:\d[\d,.]*|{SLOT})( +){COUNTER}")
# A space between Japanese and a Latin word, a number or inline code (「GPU を」「`replicate` で」「最初の 18枚」).
# A number followed by Japanese is not checked: it is usually a counter, and counters are an open list.
JA_THEN_LATIN = re.compile(f"(?<!第)(?!(?<=\\d)対)[{JA_CHARS}][A-Za-z0-9]")  # 「第1」「1対1」 are words
LATIN_THEN_JA = re.compile(f"[A-Za-z][{JA_CHARS}]")
LETTER_AND_COUNTER = re.compile(rf"(?<![A-Za-z])[A-Za-z]{COUNTER}")  # 「n個」: a variable counts like a number
ONE_WORD = ("Tシャツ",)  # words that join a Latin letter and kana
# The "one spelling" table of GLOSSARY.md: a pattern of the form not to use, and the form to use.
VARIANTS = [
    (r"(?<!\d)0\d章|\d\d_\w+ ?章|第\d+章", "the number alone: 5章"),
    (r"スモーク(?!テスト)|フル ?プロファイル", "`smoke` プロファイル / `full` プロファイル"),
    (r"チャンネル", "チャネル"),
    (r"活性(?!化)", "活性化"),
    (r"普通", "ふつう"),
    (r"分か(?:らな|らず|り|る|っ|れば)", "わかる"),  # not 「この節の分から」 (分 + から)
]
MARKDOWN_VARIANTS = [(r"(?<![\w`])(?:smoke|full) ?プロファイル", "`smoke` プロファイル (in code font)")]
ITALICS = [re.compile(r"(?<!\*)\*(?![\s*])([^*\n]+?)(?<![\s*])\*(?!\*)"),
           re.compile(r"(?<![\w_])_(?![\s_])([^_\n]+?)(?<![\s_])_(?![\w_])")]
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
MATH = re.compile(r"\$\$.+?\$\$|\$[^$\n]+\$", re.S)
HTML = re.compile(r"<!--.*?-->|</?[A-Za-z][^>\n]*>", re.S)
LINK = re.compile(r"!?\[([^\]\n]*)\]\([^)\s]*\)")
URL = re.compile(r"https?://[^\s)）]+")


def plain(markdown, code="CODE"):
    """The text a reader sees: code blocks dropped, inline code, math and URLs replaced by a Latin placeholder
    (they are Latin text for the spacing rules), links reduced to their text, HTML removed."""
    text = CODE_SPAN.sub(code, FENCE.sub("", markdown))
    text = URL.sub("URL", LINK.sub(r"\1", HTML.sub("", MATH.sub("MATH", text))))
    return text


def shown(text, start, end):
    return repr(text[max(0, start - 8): end + 8].replace("\n", " ").replace(SLOT, "{…}"))


def joined(m):
    """A number and its counter as they should be written: the space taken out."""
    return m.group().replace(m.group(1), "").replace(SLOT, "{…}")


def spacing_problems(text):
    """Spaces between a number and its counter, and missing spaces between Japanese and Latin text."""
    found = [f"no space between a number and its counter, write {joined(m)!r}: {shown(text, m.start(), m.end())}"
             for m in SPACED_COUNTER.finditer(text)]
    found += [f"put a space between Japanese and Latin text or a number: {shown(text, m.start(), m.end())}"
              for m in JA_THEN_LATIN.finditer(text)]
    for m in LATIN_THEN_JA.finditer(text):
        if not (LETTER_AND_COUNTER.match(text, m.start()) or
                any(w in text[max(0, m.start() - 5): m.end() + 5] for w in ONE_WORD)):
            found.append(f"put a space between Latin text and Japanese: {shown(text, m.start(), m.end())}")
    return found


def variant_problems(text, markdown=False):
    """Forms that the glossary's table "One spelling for each word" replaces by another."""
    rules = VARIANTS + (MARKDOWN_VARIANTS if markdown else [])
    return [f"{m.group()!r} in {shown(text, m.start(), m.end())}: write {chosen} (GLOSSARY.md)"
            for pattern, chosen in rules for m in re.finditer(pattern, text)]


def italic_problems(markdown):
    """Japanese text in italics (*…* or _…_); bold (**…**) and italic Latin such as math variables are fine."""
    text = plain(markdown, code="").replace("**", "")
    return [f"italic Japanese {m.group()!r}: use bold, 「」 or no emphasis" for rx in ITALICS
            for m in rx.finditer(text) if JA_LETTER.search(m.group(1))]


def prose_problems(markdown):
    """Every mechanical rule, for one markdown cell of the Japanese edition."""
    text = plain(markdown).replace("**", "")
    return spacing_problems(text) + variant_problems(text, markdown=True) + italic_problems(markdown)


def literal_text(node):
    """The text of a string literal, an f-string (each {...} becomes SLOT) or a sum of them; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else SLOT for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal_text(node.left), literal_text(node.right)
        return None if left is None or right is None else left + right
    return None


def japanese_tr_strings(source):
    """``(line, text)`` of the Japanese argument of every ``tr(en, ja)`` call in Python ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and len(node.args) >= 2 and "tr" in (getattr(node.func, "id", None),
                                                                            getattr(node.func, "attr", None)):
            text = literal_text(node.args[1])
            if text is not None and JA_LETTER.search(text):
                yield node.lineno, text


def test_rule_counters_and_spacing():
    for good in ["GPU 2枚を使います。", "最初の 18枚です。", "`replicate` で複製します。", "5エポック訓練します。",
                 "CPU（ホスト）に置きます。", "「GPU」と呼びます。", "1,000万行あります。", "最初の n個です。",
                 "Tシャツ/トップス", "GPU 0 と GPU 1 です。", "約 0.17 ms です。", f"GPU {SLOT}枚です。",
                 "1〜3章で扱います。", "ResNet-18 を訓練します。", "1対1通信です。"]:
        assert spacing_problems(plain(good)) == [], good
    for bad in ["GPU 2 枚", "5 エポックが終わりました", "3 回の平均", "GIL は 1 つ", "2017 年", f"{SLOT} 個の値",
                "のように1つのデバイス", "GPUを使います", "CODEを呼びます", "`x`を返します", "はGPU です",
                "ときに1回だけ"]:
        assert spacing_problems(plain(bad)), bad


def test_rule_variants():
    for good in ["5章で扱います。", "1〜3章", "`smoke` プロファイル", "チャネル数", "活性化関数と活性化", "ふつうの層",
                 "わかりやすい", "10クラスに分かれています", "スモークテスト", "この節の分から先に見ます"]:
        assert variant_problems(plain(good), markdown=True) == [], good
    for bad in ["05章で扱います", "06_ddp 章", "03_primitives 章", "第5章", "スモークプロファイル", "フルプロファイル",
                "チャンネル", "活性を転送します", "普通のメモリ", "分かりやすい", "分からない", "分かれば"]:
        assert variant_problems(plain(bad)), bad
    assert variant_problems(plain("smoke プロファイルでは"), markdown=True), "a profile name outside code font"
    assert variant_problems("smoke プロファイルでは") == [], "a printed string has no code font"


def test_rule_no_italic_japanese():
    for good in ["*S* 個のステージ", "時間は *(m + S - 1) / m* です", "**太字**は使えます", "- 箇条書き\n* 箇条書き",
                 "2 * 3 と 4 * 5", "`*すべての*` はコードです", "MPARLIB_PROFILE を設定します", "*pinned* memory"]:
        assert italic_problems(good) == [], good
    for bad in ["テーブルも含めて*すべての*パラメータ", "段（*ステージ*）", "探すのは *ラッパー自身の* 表", "_すべて_ です"]:
        assert italic_problems(bad), bad


def test_rule_tr_strings_are_found_in_sources():
    source = ('from mparlib.lang import tr\nimport mparlib\n'
              'a = tr("Done", "終わりました")\n'
              'b = mparlib.lang.tr(f"{n} epochs", f"{n} エポック")\n'
              'c = tr("x", "前半" + "後半")\n'
              'd = tr("English only", "English only")\n'
              'e = other("x", "日本語")\n')
    found = dict(japanese_tr_strings(source))
    assert found == {3: "終わりました", 4: f"{SLOT} エポック", 5: "前半後半"}
    assert spacing_problems(found[4]), "the spaced counter after an f-string's number is caught"


@pytest.mark.parametrize("name", NAMES)
def test_japanese_prose_follows_the_mechanical_rules(name):
    problems = [f"markdown cell {i}: {p}" for i, text in enumerate(cells(JA / name, "markdown"))
                for p in prose_problems(text)]
    assert not problems, f"ja/{name}:\n" + "\n".join(problems)


TR_SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py")) + sorted((ROOT / "mparlib").glob("*.py"))


@pytest.mark.parametrize("path", TR_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_japanese_tr_strings_follow_the_mechanical_rules(path):
    problems = [f"line {line}: {p}" for line, text in japanese_tr_strings(path.read_text(encoding="utf-8"))
                for p in spacing_problems(text) + variant_problems(text)]
    assert not problems, f"{path.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_glossary_lists_every_spelling_the_checks_enforce():
    glossary = (ROOT / "notebooks" / "GLOSSARY.md").read_text(encoding="utf-8")
    table = glossary.split("表記の統一", 1)[1].split("\n\n", 2)[1]
    for _, chosen in VARIANTS:
        for form in chosen.split(": ")[-1].split(" / "):
            assert form in table, f"GLOSSARY.md's table of spellings lacks {form!r}, which the checks require"


# --- What the Japanese notebooks print ----------------------------------------------------------------------------
# Output lines of the Japanese edition are Japanese (through tr()), except what is code-like and reads the same in
# both languages. A line that has no Japanese fails when it still has an English word once these are set aside:
# - quoted strings ('cat', "module"), reprs in angle brackets (<All keys matched successfully>), names followed by
#   "(" or "=" (tensor(...), device(type=...), dtype=...) and the arguments of such a call, dotted names, names
#   with digits or underscores (torch.float32, resnet_block1, grad_fn), capitalised words (class names such as
#   Linear, units such as KiB), words of one or two letters (fc, us, x), a lowercase name that starts a line and
#   is followed by two or more spaces (the name column of a table of parameters or modules:
#   "pos      (Shard(dim=0),)"), and the names in CODE_WORDS;
# - the message of an exception (a line with "SomeError: ..." and the indented lines after it), which the library
#   prints in its own words, as the reader will see it on their own machine;
# - the rows of mparlib.report()'s table of software and hardware, names like `pip list` prints;
# - the output of a cell that prints source code (inspect.getsource).

QUOTED = re.compile(r"'[^'\n]*'|\"[^\"\n]*\"")
ANGLE_REPR = re.compile(r"<[^<>\n]*>")
CALL = re.compile(r"[A-Za-z_][\w.]*\([^()\n]*\)")  # f(a, b=1): code, arguments included
NAME_COLUMN = re.compile(r"^\s*[a-z_][\w.]*(?= {2,}\S)")
ENGLISH_WORD = re.compile(r"(?<![\w.\-/])[a-z]{3,}(?![\w.(=\-/])")
CODE_WORDS = {"cpu", "cuda", "gloo", "nccl", "mps", "nan", "inf", "torch", "mparlib", "python", "fsdp"}  # fsdp: layout names
EXCEPTION_LINE = re.compile(r"\b[A-Z]\w*(?:Error|Exception|Interrupt)\b:")
REPORT_ROW = re.compile(r"^(?:python|torch|CUDA \(build\)|cuDNN|cuda:\d+) {2,}\S")
PRINTS_SOURCE = re.compile(r"\binspect\.getsource\(")
OUTPUT_COUNTER = re.compile(rf"\d[\d,.]*( ){COUNTER}")  # one space: aligned columns of a table use several


def outside_exceptions(text):
    """The lines of one output text, without exception messages (a line with "SomeError: ..." and the indented
    lines after it), which the library prints in its own words."""
    in_exception = False
    for line in text.splitlines():
        if in_exception and line[:1].isspace():
            continue
        in_exception = bool(EXCEPTION_LINE.search(line))
        if not in_exception:
            yield line


def code_removed(line):
    """One output line without its code-like parts (quoted strings, reprs, calls); a label may start the line."""
    return CALL.sub(" ", ANGLE_REPR.sub(" ", QUOTED.sub(" ", line)))


def english_lines(text):
    """The lines of one output text that are English (see above); [] when every line is Japanese or code-like."""
    return [line for line in outside_exceptions(text) if not (JA_LETTER.search(line) or REPORT_ROW.match(line))
            and any(w not in CODE_WORDS for w in ENGLISH_WORD.findall(code_removed(NAME_COLUMN.sub(" ", line))))]


def printed_texts(path):
    """``(cell id, text)`` of every stream output, and of every result whose only form is text."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    for cell in nb["cells"]:
        if cell["cell_type"] != "code" or PRINTS_SOURCE.search("".join(cell["source"])):
            continue
        for out in cell.get("outputs", []):
            if out["output_type"] == "stream":
                yield cell.get("id"), "".join(out["text"])
            elif out["output_type"] in ("execute_result", "display_data") and set(out["data"]) == {"text/plain"}:
                yield cell.get("id"), "".join(out["data"]["text/plain"])


def test_rule_english_output_lines():
    for good in ["tensor([[0., 0.],\n        [1., 1.]], dtype=torch.float64)", "[device(type='cpu')]", "True",
                 "['cat', 'dog', 'bird'] Linear", "<All keys matched successfully>", "plot.png", "(18, 1, 28, 28)",
                 "resnet_block1    (1, 64, 28, 28)", "CheckpointMismatchError", "DeviceError True True",
                 "replicate       ValueError: Expected a non cpu device, but got: cpu",
                 "RuntimeError: Error(s) in loading state_dict for Classifier:\n    Missing key(s) in state_dict: ...",
                 "python        3.11.7\ncuDNN         92400\nCPU スレッド数  2", "  2.71 ms  x1.00  分割なし",
                 "レプリカ 0（cpu）: 形状 (3, 10)、行 [0, 1, 2]", "try_gpu(0):     cpu", "{'epoch': 3}",
                 "model.dim: 16   awrapped.dim: 16", "4 KiB      2.5 us      5.2 us    0.78  ページング可能",
                 "dist.send(x, dst=1) / dist.recv(buf, src=0)", "    pos                      (Shard(dim=0),)"]:
        assert english_lines(good) == [], good
    for bad in ["replica 0 on cpu: shape (3, 10), rows [0, 1, 2]", "same parameters after one step: True",
                "lazy layers before the first forward pass: 35", "checked", "stopped after 5 calls",
                "test acc: 0.67, 20.0 sec/epoch on [device(type='cpu')]", "GPUs: 0\noutput on cpu",
                "ValueError: bad\nthe next line is not part of the message", "8 rows on 1 device(s)",
                 "one large batch                                 0.0e+00           57.7",
                 "mode                          size    returned    finished    GB/s",
                 "predict      on the model: True   on the wrapper: False", "CPU threads   2", "profile       smoke"]:
        assert english_lines(bad), bad


@pytest.mark.parametrize("name", NAMES)
def test_the_japanese_notebooks_print_japanese(name):
    problems = []
    for cell_id, text in printed_texts(JA / name):
        problems += [f"cell {cell_id}: English output line {line[:100]!r}: print it through "
                     "mparlib.lang.tr(en, ja)" for line in english_lines(text)]
        problems += [f"cell {cell_id}: no space between a number and its counter: {m.group()!r}"
                     for m in OUTPUT_COUNTER.finditer(text)]
    assert not problems, f"ja/{name}:\n" + "\n".join(problems)


# --- Labels, lists and tables in the Japanese outputs ----------------------------------------------------------
# A Japanese line may still carry an English label (「params 予測 555,560」), join Japanese items with a half-width
# comma (「チャンク 3, 1->2: チャンク 0」), or belong to a table padded by characters, whose columns drift by one
# place for every Japanese character before them. These rules read every stored Japanese output, lines with
# Japanese included, except what english_lines sets aside as code.

def output_labels():
    """The English labels of GLOSSARY.md's "Labels in printed output" table (its left column)."""
    glossary = (ROOT / "notebooks" / "GLOSSARY.md").read_text(encoding="utf-8")
    section = glossary.split("## Labels in printed output", 1)[1]
    rows = [line.split("|")[1].strip() for line in section.splitlines() if line.startswith("| ")][1:]
    return [label.strip() for row in rows for label in row.split(" / ")]


def label_pattern(labels):
    words = "|".join(re.escape(w) for w in sorted(labels, key=len, reverse=True))
    return re.compile(rf"(?<![\w.\-/])(?:{words})(?![\w.(=\-/])", re.I)


LABEL = label_pattern(output_labels())


def label_problems(text, pattern=LABEL):
    """English labels of the glossary's output table in the lines of one Japanese output."""
    return [f"the English label {m.group()!r} in {line.strip()[:100]!r}: use the glossary's Japanese label"
            for line in outside_exceptions(text) for m in pattern.finditer(code_removed(line))]


def output_comma_problems(text):
    """Half-width ", " between the items of a Japanese line, outside brackets and quotes (``(3, 4)`` is a value)."""
    problems = []
    for line in outside_exceptions(text):
        if not JA_LETTER.search(line):
            continue
        depth, quote = 0, None
        for i, c in enumerate(line):
            if quote:
                quote = None if c == quote else quote
            elif c in "'\"":
                quote = c
            elif c in "([{（「":
                depth += 1
            elif c in ")]}）」":
                depth = max(0, depth - 1)
            elif c == "," and depth == 0 and line[i + 1:i + 2] == " ":
                problems.append(f"a half-width comma between Japanese items, join them with 、 (mparlib.lang.join): "
                                f"{line.strip()[:100]!r}")
                break
    return problems


COLUMN = re.compile(r"\S+(?: \S+)*")  # a cell: words one space apart; two or more spaces end it


def columns(line):
    """``(start, end)`` of every cell of a table line, in characters and in display columns."""
    from mparlib.lang import display_width
    return [((m.start(), m.end()), (display_width(line[:m.start()]), display_width(line[:m.end()])))
            for m in COLUMN.finditer(line)]


def table_problems(text):
    """Runs of 2 or more lines with the same number (2 or more) of cells, of which some column lines up by characters
    (every cell starts, or every cell ends, at the same character) but not by display width."""
    problems, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        n = len(columns(lines[i]))
        j = i + 1
        while j < len(lines) and n >= 2 and len(columns(lines[j])) == n:
            j += 1
        run = lines[i:j]
        if j - i >= 2 and any(JA_LETTER.search(line) or JAPANESE.search(line) for line in run):
            cols = [columns(line) for line in run]
            for k in range(n):
                chars = [c[k][0] for c in cols]
                shown_at = [c[k][1] for c in cols]
                by_chars = len({a for a, _ in chars}) == 1 or len({b for _, b in chars}) == 1
                by_width = len({a for a, _ in shown_at}) == 1 or len({b for _, b in shown_at}) == 1
                if by_chars and not by_width:
                    problems.append(f"a table padded by characters, not display width (column {k + 1}), print it "
                                    f"with mparlib.lang.table: {run[0].strip()[:60]!r} ...")
                    break
        i = max(j, i + 1)
    return problems


def test_rule_output_labels():
    assert {"params", "grads", "optimizer", "GPUs", "bytes", "reduce-scatter", "all-gather"} <= set(output_labels())
    for good in ["パラメータ  予測  555,560", "ring_all_reduce の結果", "'fp32' 'adam' 4", "reshard_after_forward  "
                 "all_gather", "ランク 0: blocks.0.attn.q.weight", "n=2 MLP  heads=2", "dist.all_reduce と一致",
                 "RuntimeError: the ranks differ\n    in rank 1 and ranks 2"]:
        assert label_problems(good) == [], good
    for bad in ["params          予測     555,560", "モデル  mixed + Adam  + fp32 grads", "GPUs  8", "4. all-gather  0->1",
                "     bytes all_reduce ms     最小-最大 ms  回数   ring ms", "検査した場合: full contiguous"]:
        assert label_problems(bad), bad


def test_rule_output_commas():
    for good in ["画像: (18, 1, 28, 28) torch.float32 値の範囲 [0, 1]", "GPipe 8、1F1B 2", "1,111,404 バイト",
                 "no Japanese, so not this rule", "{'a': 1, 'b': 2} の辞書", "ランク 0（1, 2）", "ValueError: 値, 型"]:
        assert output_comma_problems(good) == [], good
    for bad in ["チャンク 3, 1->2: チャンク 0", "最大数: GPipe 8, 1F1B 2", "ランク 0 の持ち分: q.weight (32, 64), k.weight (32, 64)",
                "実行 ['gpipe', '1f1b'], ランク 0 のパラメータ数 71168"]:
        assert output_comma_problems(bad), bad


def test_rule_output_tables():
    from mparlib.lang import pad
    by_chars = "\n".join(f"{label:<12}{value:>8}" for label, value in [("ring", 1), ("リング全体", 22), ("tree", 333)])
    by_width = "\n".join(pad(label, 12) + pad(value, 8, ">") for label, value in [("ring", 1), ("リング全体", 22)])
    assert table_problems(by_chars) and table_problems(by_width) == []
    assert table_problems("DDP      14.0\nZeRO-1   10.5") == [], "no Japanese, nothing to drift"
    assert table_problems("合計: 3 件\n次: 4 件") == [], "sentences are not tables"


@pytest.mark.parametrize("name", NAMES)
def test_the_japanese_outputs_use_japanese_labels_lists_and_tables(name):
    problems = []
    for cell_id, text in printed_texts(JA / name):
        problems += [f"cell {cell_id}: {p}" for p in
                     label_problems(text) + output_comma_problems(text) + table_problems(text)]
    assert not problems, f"ja/{name}:\n" + "\n".join(problems)


# --- The chapter sources' Japanese --------------------------------------------------------------------------------
# The prose is edited in notebooks/src and reaches the stored notebooks at the next build, so these rules read the
# Japanese part of every markdown cell of the sources: the words of GLOSSARY.md's "one word per idea" rows, commas,
# and the form of headings, besides every rule above.

SOURCES = sorted((ROOT / "notebooks" / "src").glob("[0-9][0-9]_*.py"))
# GLOSSARY.md's rows from 集団通信 on: a pattern of the form not to use and the form to use. A word that also has
# another, correct meaning is matched only where it stands for the idea the glossary names: 接続 for a link between
# devices (not 残差接続 or an internet connection), 形 for a tensor's shape (not 「リストを受け取る形」), かける for
# applying an operator (not 時間をかける, and not 掛ける, multiplying).
TERMS = [
    (r"集団通信", "集合通信"),
    (r"不可分", "アトミック"),
    (r"回線|(?:速い|遅い|高速な|低速な)接続|接続が(?:速|遅)", "リンク"),
    (r"形(?=(?:と|、) ?dtype|のそろった|の合わない|のテンソル|を変え)|CODE ?の形(?=は|が|を)|(?:同じ|違う|どの)形(?=で)",
     "形状"),
    (r"包[まみむめもん]", "ラップする"),
    (r"計画", "プラン"),
    (r"専門家混合", "MoE"),
    (r"平らな", "フラットな"),
    (r"(?<!時間)(?<!手間)(?<!負荷)(?<!迷惑)を(?: ?\d+回だけ)?かけ", "適用する"),
    (r"グローバルバッチ", "全体のバッチサイズ"),
    (r"プリフェッチ", "先読み"),
    (r"決まった費用", "固定のコスト"),
    (r"アルファ・ベータ", "α-β モデル"),
    (r"記憶領域", "ストレージ"),
]
JA_COMMA = re.compile(f"[{JA_CHARS}）」』][ \t]*,[ \t]*(?=[{JA_CHARS}（「『])")
NOT_A_NOUN = re.compile(r"(?:です|ます|。|か)$|[？?]")  # a sentence, or a question
SUBTITLE = re.compile(r"[:：]\s*")


def term_problems(markdown):
    """Words that GLOSSARY.md's "one word per idea" rows replace by another, in one Japanese markdown cell."""
    text = plain(markdown).replace("**", "")
    return [f"{m.group()!r} in {shown(text, m.start(), m.end())}: write {chosen} (GLOSSARY.md)"
            for pattern, chosen in TERMS for m in re.finditer(pattern, text)]


def comma_problems(markdown):
    """Half-width commas between Japanese words (outside code and math), which are written 、."""
    text = plain(markdown)
    return [f"a half-width comma between Japanese words, write 、: {shown(text, m.start(), m.end())}"
            for m in JA_COMMA.finditer(text)]


def heading_form_problems(markdown):
    """Japanese headings that are not in noun form: ending in です/ます/。/か, or asking a question."""
    return [f"heading {text!r}: write it in noun form (体言止め), not as a sentence or a question"
            for _, text in headings(markdown)
            if any(NOT_A_NOUN.search(part.strip()) for part in SUBTITLE.split(plain(text, code="CODE")))]


def source_cells(path):
    """``(index, English, Japanese)`` of every markdown cell of a chapter source, as tools/notebooks.py reads it."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import notebooks as builder
    finally:
        sys.path.pop(0)
    markdown = [c.body for c in builder.parse(path) if c.kind == "markdown"]
    return [(i, body["en"], body["ja"]) for i, body in enumerate(markdown)]


def test_rule_terms():
    for good in ["集合通信を呼び出します。", "インターネット接続が必要です。", "残差接続を付けたものです。",
                 "相手が接続を閉じたときです。", "リストを受け取る形もあります。", "同じ形のメッセージになります。",
                 "`f ... g` の形になるように", "係数を掛けて求めます。", "時間をかけて訓練します。", "プラン（plan）",
                 "フラットなバッファ", "アトミックに書き込みます。", "MoE（Mixture of Experts）", "形状と dtype",
                 "速いリンクの上だけです。", "`f` を適用します。", "モジュールをラップします。"]:
        assert term_problems(good) == [], good
    for bad in ["集団通信", "不可分な操作です。", "回線が遅いとき", "速い接続の上", "接続が遅いとき", "形と dtype",
                "形のそろったテンソル", "違う形のテンソル", "`pos` の形は `(1, 16)` です", "同じ形で呼び出します",
                "`self.heads` で形を変えます", "モジュールを包み、", "残差接続で包んだもの", "計画（plan）", "専門家混合",
                "平らなバッファ", "入力に `f` をかけます。", "`copy_to_parallel` を 1回だけかけてから"]:
        assert term_problems(bad), bad


def test_rule_commas_between_japanese_words():
    for good in ["`a`, `b` を渡します。", "min(a, b) です。", "GPU 0, 1 を使います。", "ピーク、帯域幅", "$f(x, y)$ の値",
                 "1,000万行あります。", "ランク 0, 1 で", "```python\nx = f(あ, い)\n```"]:
        assert comma_problems(good) == [], good
    for bad in ["min(ピーク, 帯域幅)", "パラメータ,勾配", "（前）, 後ろ", "勾配 , 状態"]:
        assert comma_problems(bad), bad


def test_rule_headings_in_noun_form():
    for good in ["# 8. 集合通信", "### 逆伝播と重なるバケット", "## 名前が衝突するとき", "## まとめ",
                 "### ZeRO-3 と ZeRO-2 の切り替え: `reshard_after_forward`", "## 証明: 同じ出力と同じ勾配",
                 "本文は「何でしょうか？」と問いかけます。"]:
        assert heading_form_problems(good) == [], good
    for bad in ["## 時間はどこに使われているか", "### 5. DataParallel か DistributedDataParallel か",
                "### ZeRO-3 か ZeRO-2 か: `reshard_after_forward`", "## 何が起きるのでしょう？", "## これは例です",
                "## バケットは逆伝播と重なります", "## 重なる?", "## 結果。"]:
        assert heading_form_problems(bad), bad


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_japanese_of_the_sources_follows_the_writing_rules(path):
    problems = []
    for i, en, ja in source_cells(path):
        found = (term_problems(ja) + comma_problems(ja) + heading_form_problems(ja) + prose_problems(ja)
                 + heading_problems([en], [ja]))
        problems += [f"markdown cell {i}: {p}" for p in found]
    assert not problems, f"notebooks/src/{path.name} (Japanese):\n" + "\n".join(problems)


def test_the_glossary_lists_every_word_the_source_checks_enforce():
    glossary = (ROOT / "notebooks" / "GLOSSARY.md").read_text(encoding="utf-8")
    table = glossary.split("表記の統一", 1)[1].split("\n\n", 2)[1]
    for pattern, chosen in TERMS:
        assert f"| {chosen}" in table, f"GLOSSARY.md's table of spellings lacks {chosen!r}, which the checks require"
