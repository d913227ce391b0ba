"""The house has floors, and imports only point down (docs/architecture.md, "Floors").

Every module of toolkit/, converters/, recipes/, benchmarks/ and tools/ belongs to a room (the
longest prefix of its dotted name in FLOORS); a room may import only rooms on lower floors (and
itself). Every import counts, those inside functions too: a lazy import is still an arrow that a
reader follows. An arrow that points up, or between two rooms of one floor, fails with the
importing file and line; so does any import cycle between rooms (a cycle needs an arrow that does
not point down).
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

# room -> floor, lowest first. A module belongs to the room of the longest matching prefix.
FLOORS = {
    "toolkit.errors": 0,
    "toolkit.spec": 1, "toolkit.hardware": 1, "toolkit.kernels": 1, "toolkit.atomic": 1, "toolkit.quiet": 1,
    "toolkit.startup": 1,
    "toolkit.regions": 1,
    "toolkit.models": 2,
    "toolkit.parallel": 3,
    "toolkit.backends": 4,
    "toolkit.estimate": 5,
    "toolkit.plan": 6,
    "toolkit.search": 7, "toolkit.emit": 7, "toolkit.charts": 7,
    "toolkit.mcore": 8,
    "converters": 9,
    "toolkit.runtime": 10,
    "toolkit.runstate": 11, "toolkit.hf": 11, "toolkit.bridge": 11,
    "toolkit.cli": 12, "toolkit": 12,
    "toolkit.__main__": 13, "recipes": 13, "benchmarks": 13, "tools": 13,
}
PACKAGES = ("toolkit", "converters", "recipes", "benchmarks", "tools")
# Arrows the house still has (importing module -> imported module), each to be removed; nothing may join.
ALLOWED: set[tuple[str, str]] = set()


def room(module: str) -> str | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in FLOORS:
            return ".".join(parts[:n])
    return None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from pkg import mod` names a module when pkg/mod.py exists
            subs = [f"{target}.{a.name}" for a in node.names if _is_module(f"{target}.{a.name}")]
            out += [(node.lineno, t) for t in subs or [target]]
    return [(line, t) for line, t in out if t.split(".")[0] in PACKAGES]


def _is_module(dotted: str) -> bool:
    p = ROOT.joinpath(*dotted.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def arrows() -> list[tuple[str, int, str, str]]:
    """(importing file, line, importing module, imported module) across rooms."""
    out = []
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            src = module_name(path)
            for line, dst in imports(path):
                if room(src) != room(dst):
                    out.append((str(path.relative_to(ROOT)), line, src, dst))
    return out


def test_every_module_has_a_room():
    lost = sorted({module_name(p) for top in PACKAGES for p in (ROOT / top).rglob("*.py")
                   if room(module_name(p)) is None})
    assert not lost, f"modules without a room in FLOORS: {lost}"


def test_imports_only_point_down():
    bad = [f"{f}:{line}: {src} ({room(src)}, floor {FLOORS[room(src)]}) imports {dst} "
           f"({room(dst)}, floor {FLOORS[room(dst)]})"
           for f, line, src, dst in arrows()
           if FLOORS[room(src)] <= FLOORS[room(dst)] and (src, dst) not in ALLOWED]
    assert not bad, "imports that do not point down:\n" + "\n".join(bad)


def test_the_allowed_list_holds_only_arrows_that_exist():
    """An arrow removed from the code leaves the list too, so the list only shrinks."""
    seen = {(src, dst) for _, _, src, dst in arrows()}
    assert ALLOWED <= seen, sorted(ALLOWED - seen)


def test_every_import_of_the_project_resolves():
    """Each `from toolkit... import name` (or `from tests...`) in the project, tests and launched
    workers included, names a module or attribute that exists, and a worker's bare-name import
    (`from optimizer_dump import dump`, found beside the script) names a file of tests/support. A
    worker runs only inside a multi-rank launch, so a stale import there would otherwise surface as
    a failed launch, after minutes."""
    import importlib
    import importlib.util

    support = ROOT / "tests" / "support"
    bad = []
    for top in (*PACKAGES, "tests", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                    continue
                first = node.module.split(".")[0]
                beside = (support / f"{first}.py").is_file()
                if path.parent == support and not beside and first not in (*PACKAGES, "tests") \
                        and importlib.util.find_spec(first) is None:
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {node.module} beside it")
                    continue
                if first not in (*PACKAGES, "tests"):
                    continue
                module = importlib.import_module(node.module)
                for a in node.names:
                    if a.name != "*" and not hasattr(module, a.name) and not _is_module(f"{node.module}.{a.name}"):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.module} has no {a.name}")
    assert not bad, "\n".join(bad)


def test_no_name_a_package_exports_is_also_one_of_its_submodules():
    """`from toolkit.models import families` gave the function until the subpackage `families`
    was loaded, and the subpackage after: importing a submodule sets it as the package's attribute.
    So a package may not export (``__all__``) anything under the name of one of its submodules,
    unless it is that submodule."""
    bad = []
    for top in ("toolkit", "converters"):
        for init in sorted((ROOT / top).rglob("__init__.py")):
            pkg = init.parent
            subs = {p.stem for p in pkg.glob("*.py")} | {p.name for p in pkg.iterdir() if (p / "__init__.py").is_file()}
            tree = ast.parse(init.read_text())
            exported = set()
            for node in tree.body:
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                        for t in node.targets):
                    exported |= {e.value for e in node.value.elts}
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_WHERE"
                                                        for t in node.targets):
                    exported |= {k.value for k in node.value.keys}  # lazily imported public names
            is_module = {a.asname or a.name for node in tree.body if isinstance(node, ast.ImportFrom)
                         and node.level == 1 and node.module is None for a in node.names}
            bad += [f"{init.relative_to(ROOT)}: {name}" for name in sorted(exported & subs - is_module)]
    assert not bad, "exported names that a submodule of the same name replaces once loaded:\n" + "\n".join(bad)
