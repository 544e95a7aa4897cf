"""The package's back-links are a contract: every public name says which chapter explains it, and that chapter uses it.

A docstring that ends "Explained in 05_multi_gpu_resnet." sends a reader to notebooks/src/05_multi_gpu_resnet.py; the
link is only true if that chapter's source mentions the name (in code or prose). Public means: defined at the top
level of a module in mparlib/ (not imported there) with a name that does not start with an underscore. A command
line's ``main`` is used as ``python -m mparlib.<module>`` and an IPython extension as ``%load_ext mparlib.<module>``,
so that is what their chapters must mention.
"""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mparlib"
CHAPTERS = ROOT / "notebooks" / "src"
LINK = re.compile(r"Explained in (\d\d_[a-z0-9_]+)")


def public_definitions():
    """``(module, name, docstring)`` of every public function and class defined at a module's top level."""
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                yield path.stem, node.name, ast.get_docstring(node) or ""


def uses(source, module, name):
    if name == "main":  # a command line: `python -m mparlib.train` (its parser may live in train_cli)
        return re.search(rf"mparlib\.{module.removesuffix('_cli')}\b", source) is not None
    if name == "load_ipython_extension":  # an IPython extension: `%load_ext mparlib.launch`
        return f"load_ext mparlib.{module}" in source
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", source) is not None


def test_every_public_name_links_to_a_chapter():
    missing = [f"mparlib.{m}.{n}" for m, n, doc in public_definitions() if not LINK.search(doc)]
    assert not missing, "public names without 'Explained in NN_name': " + ", ".join(missing)


def test_every_link_names_a_chapter_that_uses_the_name():
    chapters = {p.stem: p.read_text(encoding="utf-8") for p in CHAPTERS.glob("[0-9][0-9]_*.py")}
    broken = []
    for module, name, doc in public_definitions():
        for chapter in LINK.findall(doc):
            if chapter not in chapters:
                broken.append(f"mparlib.{module}.{name} -> {chapter} (no such chapter)")
            elif not uses(chapters[chapter], module, name):
                broken.append(f"mparlib.{module}.{name} -> {chapter} (the chapter never uses {name!r})")
    assert not broken, "\n".join(broken)


def test_module_docstrings_link_to_a_chapter_too():
    bad = []
    for path in sorted(PACKAGE.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        if path.name != "__init__.py" and not LINK.search(doc):
            bad.append(path.name)
    assert not bad, "modules whose docstring names no chapter: " + ", ".join(bad)


def test_the_contract_is_checked_for_real():
    # the two rules above catch a wrong link and a missing one (guards against a regex that matches nothing)
    defs = list(public_definitions())
    assert len(defs) > 60 and any(n == "ring_all_reduce" or n == "launch" for _, n, _ in defs)
    assert not uses("print(check_devices(x))", "devices", "check_device")
    assert uses("`mparlib.check_device('cpu')`", "devices", "check_device")
