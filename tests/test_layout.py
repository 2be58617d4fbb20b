"""The code layout rules of docs/architecture.md, checked on the source tree.

- no module of ``qkgeom/`` over 600 lines, no function over 80 lines;
- no import of a private name (``_x``) from another qkgeom module;
- SQL text only in ``qkgeom/store/`` and ``qkgeom/analysis/`` (docstrings and CLI help
  that *show* a query to the user are prose, not SQL the code runs);
- ``qkgeom --help`` imports neither torch, ray, sqlalchemy, polars nor altair.
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
