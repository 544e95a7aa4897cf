"""The package's layout rules, checked on its source: no import circles, no private names used outside their
module (by the package or by the tests), no function over 60 lines, no re-export lines."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mparlib"
MODULES = {p.stem: p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
MAX_LINES = 60


def parse(path):
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def mparlib_modules_bound(tree, here=None):
    """``{local name: module}`` for every mparlib module a file imports as a name, and the imports of names."""
    bound, imported = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 1 or (node.module or "").split(".")[0] == "mparlib":
                target = (node.module or "").removeprefix("mparlib").lstrip(".") if node.level == 0 else node.module
                if not target:  # from . import x / from mparlib import x: x may be a module
                    for a in node.names:
                        if a.name in MODULES:
                            bound[a.asname or a.name] = a.name
                            imported.append((a.name, None, node.lineno))
                        else:
                            imported.append(("__init__", a.name, node.lineno))
                else:
                    mod = target.split(".")[0]
                    for a in node.names:
                        imported.append((mod, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] == "mparlib" and len(parts) > 1 and parts[1] in MODULES:
                    imported.append((parts[1], None, node.lineno))
                    if a.asname:
                        bound[a.asname] = parts[1]
    return bound, imported


def private_uses(tree, bound):
    """``(module, name, line)`` for each ``module._name`` attribute read through a bound mparlib module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            value = node.value
            if isinstance(value, ast.Name) and value.id in bound:
                found.append((bound[value.id], node.attr, node.lineno))
            elif (isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name) and value.value.id == "mparlib"
                  and value.attr in MODULES):
                found.append((value.attr, node.attr, node.lineno))
    return found


def import_graph():
    graph = {}
    for name, path in MODULES.items():
        _, imported = mparlib_modules_bound(parse(path))
        graph[name] = {mod for mod, _, _ in imported if mod in MODULES and mod != name}
    return graph


def test_no_import_circles_between_modules():
    graph, circles = import_graph(), set()

    def visit(start, node, path):
        for nxt in graph[node]:
            if nxt == start:
                circles.add(" -> ".join(path + [start]))
            elif nxt not in path:
                visit(start, nxt, path + [nxt])

    for module in graph:
        visit(module, module, [module])
    assert not circles, "import circles (a __main__ block's imports count too):\n" + "\n".join(sorted(circles))


def test_no_private_name_is_used_outside_its_module():
    bad = []
    for name, path in MODULES.items():
        tree = parse(path)
        bound, imported = mparlib_modules_bound(tree)
        bad += [f"mparlib/{name}.py:{line} imports {mod}.{n}" for mod, n, line in imported
                if n and n.startswith("_") and mod != name]
        bad += [f"mparlib/{name}.py:{line} uses {mod}.{n}" for mod, n, line in private_uses(tree, bound) if mod != name]
    assert not bad, "\n".join(bad)


def test_tests_use_public_names_only():
    bad = []
    for path in sorted(ROOT.glob("tests/**/*.py")):
        tree = parse(path)
        bound, imported = mparlib_modules_bound(tree)
        if any(isinstance(n, ast.Import) and any(a.name == "mparlib" for a in n.names) for n in ast.walk(tree)):
            bound.setdefault("mparlib", "__init__")
        rel = path.relative_to(ROOT)
        bad += [f"{rel}:{line} imports {mod}.{n}" for mod, n, line in imported if n and n.startswith("_")]
        bad += [f"{rel}:{line} uses {mod}.{n}" for mod, n, line in private_uses(tree, bound)]
    assert not bad, "\n".join(bad)


def test_no_function_is_longer_than_sixty_lines():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_LINES:
                    long.append(f"mparlib/{name}.py:{node.lineno} {node.name}: {n} lines")
    assert not long, "\n".join(long)


def test_no_reexport_lines():
    bad = [f"mparlib/{name}.py:{i}" for name, path in MODULES.items()
           for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
           if "noqa: F401" in line]
    assert not bad, "imports kept only to be re-exported: " + ", ".join(bad)


@pytest.mark.parametrize("source, circle", [
    ("from .b import x", True), ("if __name__ == '__main__':\n    from .b import main", True), ("import os", False)])
def test_the_circle_check_sees_function_level_and_main_block_imports(source, circle, tmp_path):
    # guards against a walker that misses imports inside functions or the __main__ block
    _, imported = mparlib_modules_bound(ast.parse(source))
    assert (("b", "x", 1) in imported or any(m == "b" for m, _, _ in imported)) is circle
