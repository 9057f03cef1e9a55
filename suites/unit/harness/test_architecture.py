"""The import rules of docs/architecture.md, read from every module's imports."""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PARTS = ("mhc_core", "harness", "suites", "tools", "ci")
NEVER = {
    "mhc_core": {"harness", "suites", "tools", "ci"},
    "harness": {"suites", "tools", "ci"},
    "tools": {"harness", "suites", "ci"},
    "suites": {"ci"},
    "ci": {"suites"},
}
"""docs/architecture.md, "Which may import which": the parts each part never imports (lazily or not)."""
_ABOVE_GOLDEN = {
    "harness.perf",
    "harness.upstream",
    "harness.launch",
    "harness.training",
    "harness.peers",
    "harness.conformance",
    "harness.cli",
    "harness.runner",
    "harness.report",
    "harness.pytest_plugin",
    "harness.progress",
    "harness.plots",
}
NEVER_WITHIN = {
    "harness/peers": {"harness.conformance"},
    "harness/training": {"harness.launch"},
    "harness/golden": _ABOVE_GOLDEN,
    "harness/perf": _ABOVE_GOLDEN - {"harness.perf", "harness.plots"},
    "harness/upstream": _ABOVE_GOLDEN - {"harness.upstream"} | {"harness.golden"},
}
"""docs/architecture.md: the arrows within a part (the adapters never import the checks that run them; the golden
store is the harness's floor; perf history reads goldens, a tree's support reads neither)."""


def _imports(path: Path, *, top_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in `path` (only the module-level statements when asked)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _modules(part: str) -> list[Path]:
    return sorted(
        p for p in (ROOT / part).rglob("*.py") if not {".tox", "build"} & set(p.relative_to(ROOT).parts)
    )


@pytest.mark.parametrize("part", sorted(NEVER))
def test_no_part_imports_a_part_above_it(part):
    """mhc_core imports no harness, suite, tool or CI script; harness no suite, tool or CI; tools no harness."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _modules(part)
        for line, module in _imports(path)
        if module.split(".")[0] in NEVER[part]
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("folder", sorted(NEVER_WITHIN))
def test_no_arrow_points_up_within_a_part(folder):
    """harness.peers (the adapters) imports nothing of harness.conformance (the checks, matrix, recordings);
    harness.training (inside a rank) nothing of harness.launch (what starts the ranks); harness.golden nothing
    of the rooms above it."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted((ROOT / folder).rglob("*.py"))
        for line, module in _imports(path)
        if any(module == m or module.startswith(m + ".") for m in NEVER_WITHIN[folder])
    ]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_private_module_of_another_package():
    """A module of this repository named `_x` is private to its package: nothing outside it imports it (third
    parties' private modules, torch._inductor and the like, are theirs to judge)."""
    bad = []
    for part in PARTS:
        for path in _modules(part):
            package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
            for line, module in _imports(path):
                names = module.split(".")
                if names[0] not in PARTS:
                    continue
                private = next(
                    (i for i, n in enumerate(names) if n.startswith("_") and not n.startswith("__")), None
                )
                if private is not None and ".".join(names[:private]) != package:
                    bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


_SUITE_USE = re.compile(r"^\s*(from|import)\s+suites\b|-m\s+suites(\.|\b)", re.MULTILINE)
"""A suite module imported by the inline Python of a CI script, or run as one (`python -m suites.perf.table`)."""


def _ci_uses_of_suites(ci: Path) -> list[str]:
    """`file:line: text` of each use of a suite module in the scripts under `ci` (shell and Python)."""
    out = []
    for p in sorted([*ci.rglob("*.sh"), *ci.rglob("*.py")]):
        text = p.read_text(encoding="utf-8")
        out += [
            f"{p.relative_to(ci.parent)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0).strip()}"
            for m in _SUITE_USE.finditer(text)
        ]
    return out


def test_no_ci_script_uses_a_suite():
    """CI calls installed code only: no CI script imports a suite module or runs one with `python -m` (they
    read recipe data; the suites run through pytest)."""
    bad = _ci_uses_of_suites(ROOT / "ci")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "planted",
    ['"$PY" -m suites.perf.table "$OUT/perf.json"', "python3 -m suites", "from suites.pp.cases import CASES"],
)
@pytest.mark.parametrize("script", ["job.sh", "job.py"])
def test_a_planted_use_of_a_suite_in_ci_is_caught(tmp_path, planted, script):
    """The check above sees a suite run as a module or imported, in a shell script and in a Python one."""
    ci = tmp_path / "ci"
    ci.mkdir()
    (ci / script).write_text(f"set -e\necho start\n{planted}\n", encoding="utf-8")
    found = _ci_uses_of_suites(ci)
    assert len(found) == 1 and found[0].startswith(f"ci/{script}:3: "), found


def test_only_mhc_core_megatron_imports_megatron_at_module_level():
    """`import mhc_core` works without megatron-core: no other mhc_core module imports it at module level."""
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _modules("mhc_core")
        if "megatron" not in path.relative_to(ROOT / "mhc_core").parts
        for line, module in _imports(path, top_level_only=True)
        if module.split(".")[0] == "megatron"
    ]
    assert not bad, "\n".join(bad)


def test_the_rules_see_every_part():
    """The check reads real modules of each part (a moved directory would make it pass vacuously)."""
    for part in PARTS:
        assert _modules(part), part
    assert any(m.startswith("harness") for p in _modules("suites") for _, m in _imports(p))


def test_a_lazy_import_counts_and_a_top_level_one_is_told_apart(tmp_path):
    """An import inside a function is an import (it breaks an install without that part); the megatron
    rule looks at module-level statements only."""
    mod = tmp_path / "m.py"
    mod.write_text("import torch\n\ndef f():\n    from harness.cli import main\n    import megatron.core\n")
    assert {m for _, m in _imports(mod)} == {"torch", "harness.cli", "megatron.core"}
    assert {m for _, m in _imports(mod, top_level_only=True)} == {"torch"}


_REST = re.compile(r"``[^`]|:(?:py:)?(?:class|func|mod|meth|attr|data|exc|obj|const|ref):`")
"""reST markup: a double-backtick literal or a role (the docstrings use Markdown backticks)."""


def _docstrings_and_comments(path: Path) -> list[tuple[int, str]]:
    src = path.read_text(encoding="utf-8")
    out = [
        (node.lineno, node.value.value)
        for node in ast.walk(ast.parse(src))
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    ]
    out += [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(src).readline)
        if t.type == tokenize.COMMENT
    ]
    return out


def test_docstrings_use_one_style():
    """Docstrings and comments use Markdown backticks, `x`, in every part: no reST double-backtick literal
    and no reST role (class, func, mod, ...); a fenced code block is Markdown and allowed."""
    bad = [
        f"{path.relative_to(ROOT)}:{line}: {text.strip().splitlines()[0][:80]}"
        for part in PARTS
        for path in _modules(part)
        for line, text in _docstrings_and_comments(path)
        if _REST.search(text.replace("```", ""))
    ]
    assert not bad, "\n".join(bad)


def _module_graph(parts: tuple[str, ...]) -> dict[str, set[str]]:
    """`{module: modules of `parts` it imports (lazily or not)}`; `from pkg import sub` is an edge to `pkg.sub`
    alone (the package's `__init__` runs first, as for every submodule, and is no dependency of its own)."""
    mods = {}
    for part in parts:
        for path in _modules(part):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        out = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in mods]
                targets = subs + ([node.module] if len(subs) < len(node.names) else [])
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    out.add(target)
        graph[name] = out
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """No module of mhc_core, harness or tools imports, through any chain of imports (lazy ones included),
    a module that imports it back."""
    assert not _cycles(_module_graph(("mhc_core", "harness", "tools")))


def test_a_cycle_is_seen(tmp_path, monkeypatch):
    """The cycle check finds a lazy two-module cycle, and a package importing its own submodules is none."""
    for rel, text in {
        "mhc_core/__init__.py": "from mhc_core import a\n",
        "mhc_core/a.py": "def f():\n    import mhc_core.b\n",
        "mhc_core/b.py": "from mhc_core.a import f\n",
    }.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _cycles(_module_graph(("mhc_core",))) == [["mhc_core.a", "mhc_core.b"]]


def test_the_harness_reads_no_file_under_suites():
    """No harness module names `suites` as a path part in code (strings in docstrings and comments aside): what
    the harness reads (recipes, corpus, recordings) is its package data, so an installed harness finds it."""
    pattern = re.compile(r"""(/\s*["']suites["'])|(["']suites/[\w./-]+["'])""")
    bad = []
    for path in _modules("harness"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
                text = ast.get_source_segment(path.read_text(encoding="utf-8"), node) or ""
                if pattern.search(text):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
            elif (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and re.fullmatch(
                    r"suites/(functional|pp|perf|unit|conformance)/[\w./-]*\.(yaml|txt|json)", node.value
                )
            ):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not bad, "\n".join(bad)
    from harness.training.data import DATA_DIR
    from harness.training.recipe import RECIPE_DIR, recipe_names

    assert (ROOT / "harness") in RECIPE_DIR.parents and (ROOT / "harness") in DATA_DIR.parents
    assert len(recipe_names()) >= 10 and (DATA_DIR / "declaration.txt").is_file()
