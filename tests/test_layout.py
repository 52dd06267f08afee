"""The import layout, read from the source (every import, at the top or inside a function):
launch/ -> actors/ -> minirl/, never back; the core library (minirl/*.py) imports neither the
recipes (minirl/recipes/) nor Ray; no two modules of minirl/ import each other through any path;
README's Layout block names every module.

Needs: CPU only, nothing imported (ast); well under a second.
"""

import ast
from pathlib import Path

from conftest import ROOT


def _module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    """Every module path.py names in an import statement, relative imports resolved."""
    names, pkg = set(), _module(path).rsplit(".", 1)[0] if path.name != "__init__.py" else _module(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}       # `from minirl import tasks` names a module
    return names


def _files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def _graph() -> dict[str, set[str]]:
    """module -> the modules of minirl/ it imports; packages (an __init__.py re-exporting its modules)
    are left out, as importing one of their modules runs them first by design."""
    mods = {_module(p): p for p in _files("minirl") if p.name != "__init__.py"}
    return {m: {n for n in _imports(p) if n in mods and n != m} for m, p in mods.items()}


def test_imports_run_launch_actors_minirl_never_back():
    for p in _files("minirl"):
        bad = {n for n in _imports(p) if n.split(".")[0] in {"actors", "launch", "benchmarks", "ray"}}
        assert not bad, f"{p.relative_to(ROOT)} imports {sorted(bad)}"
    for p in _files("actors"):
        bad = {n for n in _imports(p) if n.split(".")[0] in {"launch", "benchmarks"}}
        assert not bad, f"{p.relative_to(ROOT)} imports {sorted(bad)}"


def test_the_core_never_imports_the_recipes():
    for p in [*sorted((ROOT / "minirl").glob("*.py")), *_files("actors")]:
        bad = {n for n in _imports(p) if n.startswith("minirl.recipes")}
        assert not bad, f"{p.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_import_circle_in_minirl():
    graph = _graph()
    assert "minirl.recipes.tasks" in graph and "minirl.recipes.rewards" in graph["minirl.recipes.tasks"]

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in graph[todo.pop()] - seen:
                seen.add(n)
                todo.append(n)
        return seen
    circles = sorted(m for m in graph if m in reach(m))
    assert not circles, f"modules on an import circle: {circles}"


def test_the_layout_reader_sees_a_circle():
    """The check above can fail: two modules written to import each other are found."""
    a, b = ROOT / "minirl" / "_circle_a.py", ROOT / "minirl" / "_circle_b.py"
    try:
        a.write_text("def f():\n    from minirl import _circle_b\n")
        b.write_text("from minirl._circle_a import f\n")
        graph = _graph()
        assert "minirl._circle_b" in graph["minirl._circle_a"] and "minirl._circle_a" in graph["minirl._circle_b"]
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


def test_the_readme_layout_names_every_module():
    """README's Layout block names each module of minirl/, minirl/recipes/, actors/, launch/ and
    benchmarks/ in its folder's entry, so a new file cannot go unlisted."""
    import re
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```")[1]
    entries, folder = {}, None
    for line in block.splitlines():
        if m := re.match(r"(\S+/)\s", line):
            folder = m.group(1)
        if folder:
            entries[folder] = entries.get(folder, "") + line
    missing = {folder: [p.stem for p in sorted((ROOT / folder).glob("*.py")) if p.stem != "__init__"
                        and not re.search(rf"\b{p.stem}\b", entries.get(folder, ""))]
               for folder in ("minirl/", "minirl/recipes/", "actors/", "launch/", "benchmarks/")}
    assert not any(missing.values()), f"README's Layout lacks {missing}"
