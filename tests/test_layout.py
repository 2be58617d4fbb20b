"""The code layout rules of docs/architecture.md, checked on the source tree.

- no module of ``qkgeom/`` over 600 lines, no function over 80 lines;
- no import of a private name (``_x``) from another qkgeom module;
- SQL text only in ``qkgeom/store/`` and ``qkgeom/analysis/`` (docstrings and CLI help
  that *show* a query to the user are prose, not SQL the code runs);
- ``qkgeom --help`` imports neither torch, ray, sqlalchemy, polars nor altair;
- each package imports only the packages below it (``LAYERS``, the table of
  docs/architecture.md), lazily or not.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "qkgeom"
SOURCES = sorted(PKG.rglob("*.py"))
SQL = re.compile(r"\b(SELECT\s.+\sFROM|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|"
                 r"CREATE\s+(TEMP\s+)?(TABLE|VIEW|INDEX))\b", re.I | re.S)
SQL_HOMES = ("qkgeom/store/", "qkgeom/analysis/")


# The layers, bottom up: each package and the packages it may import. "qkgeom" is the
# shared vocabulary at the top of the tree (errors, config, records, atomic, names). cli may
# import all.
LAYERS: dict[str, tuple[str, ...]] = {
    "qkgeom": (),
    "engine": ("qkgeom",),
    "stats": ("qkgeom",),
    "store": ("qkgeom",),
    "plan": ("qkgeom", "store"),
    "analysis": ("qkgeom", "store", "stats", "plan"),
    "report": ("qkgeom", "store", "stats", "plan", "analysis"),
    "web": ("qkgeom", "store", "stats", "plan", "analysis", "report"),
    "sweeps": ("qkgeom", "engine", "store", "plan"),
    "pretrained": ("qkgeom", "engine", "store", "stats", "sweeps"),
    "cli": ("qkgeom", "engine", "store", "stats", "plan", "analysis", "report", "web",
            "sweeps", "pretrained"),
}
# the package's front door (``qkgeom.open_study``) and the old module paths' aliases
FACADES = ("qkgeom/__init__.py", "qkgeom/compat.py")
LEAF = {"errors", "config", "records", "atomic", "names", "__version__"}


def rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def prose_constants(tree: ast.AST) -> set[int]:
    """ids of string constants that are docstrings, ``help=``/``epilog=`` texts or text
    printed to the user with ``echo`` (a suggested command is prose)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            out.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in ("help", "epilog"):
            out.update(id(n) for n in ast.walk(node.value) if isinstance(n, ast.Constant))
        f = getattr(node, "func", None)
        if isinstance(node, ast.Call) and getattr(f, "attr", getattr(f, "id", "")) == "echo":
            out.update(id(n) for a in node.args for n in ast.walk(a)
                       if isinstance(n, ast.Constant))
    return out


def layer_of(module: str) -> str:
    """``qkgeom.engine.model`` -> ``engine``; ``qkgeom.config`` -> ``qkgeom``."""
    parts = module.split(".")
    return "qkgeom" if len(parts) == 1 or parts[1] in LEAF else parts[1]


def imported_layers(src: str, own: str) -> dict[str, int]:
    """Every qkgeom layer that ``src`` imports (at the top or inside functions), with the
    first line that does."""
    out: dict[str, int] = {}
    for n in ast.walk(ast.parse(src)):
        names: list[str] = []
        if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "qkgeom":
            names = ([f"qkgeom.{a.name}" for a in n.names] if n.module == "qkgeom"
                     else [n.module])
        elif isinstance(n, ast.Import):
            names = [a.name for a in n.names if a.name.split(".")[0] == "qkgeom"]
        for name in names:
            layer = layer_of(name)
            if layer != own and not name.startswith("qkgeom._shipped"):
                out.setdefault(layer, n.lineno)
    return out


def test_every_package_is_a_layer():
    found = {p.parent.name for p in PKG.glob("*/__init__.py")} - {"migrations", "presets"}
    assert found == set(LAYERS) - {"qkgeom"}, "add the package to LAYERS and the docs"
    top = {p.stem for p in PKG.glob("*.py")} - {"__init__", "compat"}
    assert top <= LEAF, f"top-level modules outside the shared vocabulary: {top - LEAF}"


@pytest.mark.parametrize("path", [p for p in SOURCES if rel(p) not in FACADES], ids=rel)
def test_imports_go_down_the_layers(path):
    own = "qkgeom" if path.parent == PKG else path.relative_to(PKG).parts[0]
    up = {layer: line for layer, line in imported_layers(path.read_text(), own).items()
          if layer not in LAYERS[own]}
    assert not up, f"{rel(path)} ({own}) imports layers above it: {up} (line numbers)"


def test_the_layer_rule_catches_an_upward_import():
    bad = ("from qkgeom.config import TrialConfig\n"
           "def f():\n    from qkgeom.report import claims\n    import qkgeom.sweeps.driver\n")
    assert imported_layers(bad, "engine") == {"qkgeom": 1, "report": 3, "sweeps": 4}
    assert {k for k in imported_layers(bad, "engine") if k not in LAYERS["engine"]} == {
        "report", "sweeps"}


def test_the_rules_see_the_package():
    assert len(SOURCES) > 30 and all(p.suffix == ".py" for p in SOURCES)


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_module_size_and_function_length(path):
    src = path.read_text()
    assert src.count("\n") <= 600, f"{rel(path)}: {src.count(chr(10))} lines (limit 600)"
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, f"{rel(path)}: functions over 80 lines: {long}"


@pytest.mark.parametrize("path", SOURCES, ids=rel)
def test_no_private_name_crosses_a_module(path):
    bad = []
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("qkgeom")):
            bad += [a.name for a in n.names if a.name.startswith("_")
                    and not a.name.startswith("__")]
    assert not bad, f"{rel(path)} imports private names {bad}"


@pytest.mark.parametrize("path", [p for p in SOURCES if not rel(p).startswith(SQL_HOMES)],
                         ids=rel)
def test_sql_lives_in_the_store_and_analysis(path):
    tree = ast.parse(path.read_text())
    prose = prose_constants(tree)
    found = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and id(n) not in prose and SQL.search(n.value)]
    assert not found, f"{rel(path)}: SQL text at lines {found}"


def test_the_rule_catches_sql_and_private_imports(tmp_path):
    # the checks above must be able to fail: run them on a bad module
    bad = ("from qkgeom.store.base import _secret\n"
           "def f(db):\n    '''SELECT x FROM y is fine in a docstring'''\n"
           "    click.echo('try: qkgeom query \"SELECT * FROM trials\"')\n"
           "    return db.execute('SELECT * FROM trials WHERE id = 1')\n")
    tree = ast.parse(bad)
    prose = prose_constants(tree)
    hits = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in prose and SQL.search(n.value)]
    assert hits == ["SELECT * FROM trials WHERE id = 1"]
    imports = [a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               for a in n.names]
    assert imports == ["_secret"]


def test_cli_help_imports_no_heavy_library():
    code = ("import sys; import qkgeom.cli; "
            "print(sorted(m for m in ('torch', 'ray', 'sqlalchemy', 'polars', 'altair') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_architecture_page_names_every_module_once():
    text = (ROOT / "docs" / "architecture.md").read_text()
    tree = text.split("## The tree", 1)[1].split("```", 2)[1]
    listed: list[str] = []
    package = ""
    for line in tree.splitlines()[2:]:  # after "qkgeom/"
        name = line.split()[0] if line.strip() else ""
        if name.endswith("/"):
            package = name
        elif name.endswith(".py"):
            listed.append(("" if line.startswith("  ") and not line.startswith("    ")
                           else package) + name)
    on_disk = sorted(p.relative_to(PKG).as_posix() for p in SOURCES
                     if p.name != "__init__.py" or p.parent == PKG)
    dup = sorted({m for m in listed if listed.count(m) > 1})
    assert not dup, f"named twice in docs/architecture.md: {dup}"
    listed_set = {m for m in listed if not m.endswith("/__init__.py")}
    assert sorted(listed_set) == on_disk, (
        f"missing from the page: {sorted(set(on_disk) - listed_set)}; "
        f"on the page, not on disk: {sorted(listed_set - set(on_disk))}")
