"""The layout shows the data flow: no module imports one that imports it back (through any chain, counting imports
inside functions too), the tap layer imports nothing of the application, and CONTRIBUTING's module map names every
module there is."""

import ast
import graphlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("steer", "interleaver", "hydra_plugins")


def _modules() -> dict:
    """Dotted module name -> source path, for every module of the project's packages."""
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, known: dict) -> set:
    """The project's modules that `name` imports anywhere in its source (a name imported from a package counts as
    the submodule when there is one of that name, else as the package)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    if name == "interleaver":  # its names load on first use, by module name (importlib)
        found.update(f"interleaver.{m}" for m in __import__("interleaver")._WHERE.values())
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph():
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def test_no_import_loops(graph):
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import loop: {' -> '.join(e.args[1])}")


def test_the_tap_layer_imports_nothing_of_the_application(graph):
    leaks = {m: sorted(i for i in deps if not i.startswith("interleaver"))
             for m, deps in graph.items() if m.startswith("interleaver")}
    assert {m: d for m, d in leaks.items() if d} == {}


def test_an_import_inside_a_function_is_an_edge(tmp_path):
    """Imports deferred into functions count: a loop made of them is still a loop."""
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from steer.runs import run\n    import steer.edits.plan as p\n")
    assert _imports("steer.m", path, _modules()) == {"steer.runs.run", "steer.edits.plan"}


def _module_map() -> dict:
    """CONTRIBUTING.md's module map as {folder: the .py names its entries give there} (a folder's entry that names
    no file stands for the folder whole: an empty set). An entry starts at a line's first column with a path (a
    folder, or a file whose folder it is); its indented lines go on with it."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    block = text.split("## Module map", 1)[1].split("```", 2)[1]
    entries, folder = {}, None
    for line in block.splitlines()[1:]:
        if line and not line[0].isspace():
            first = line.split()[0]
            folder = first if first.endswith("/") else first.rpartition("/")[0] + "/"
            entries.setdefault(folder, set())
            line = line[len(first):] if first.endswith("/") else line
        for name in __import__("re").findall(r"[\w/]+\.py\b", line):
            entries[folder].add(name if "/" in name else folder + name)
    return entries


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    entries = _module_map()
    named = set().union(*entries.values())
    assert sorted(p for p in named if not (ROOT / p).is_file()) == [], "CONTRIBUTING's module map names files " \
                                                                     "that are not in the tree"
    missing = []
    for path in sorted(p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        folder = path.rpartition("/")[0] + "/"
        whole = any(folder.startswith(f) and not entries[f] for f in entries)  # a folder described whole
        if path.endswith("__init__.py") and path != "steer/__init__.py" or path in named or whole:
            continue
        missing.append(path)
    assert missing == [], "CONTRIBUTING's module map does not name these modules"
