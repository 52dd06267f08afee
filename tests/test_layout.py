"""The import layout, read from the source (every import, at the top or inside a function):
launch/ -> actors/ -> minirl/, never back; the core library (minirl/*.py) imports neither the
recipes (minirl/recipes/) nor Ray.

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
