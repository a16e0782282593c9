"""Checks on the README as a front page (issue 32, item 6) and on the import graph of ``kvforge/``.

- the README is at most 250 lines and every relative path it names exists;
- every ``KVFORGE_*`` variable read anywhere in ``kvforge/`` is a row of its environment-variable table;
- its two fresh-machine commands are the ones ``.ci/run`` runs (same torch pin, the extras CI installs, the
  same test command);
- no import cycle inside ``kvforge/``: neither among module-level imports (a module's body, top-level
  ``if``/``try`` included) nor once deferred, function-level imports count too (a circle closed inside a
  function is still a circle); ``if TYPE_CHECKING:`` imports never run and are left out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_import_layers import _cycles

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    m = re.search(rf"^## {re.escape(heading)}\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert m, f"README has no '## {heading}' section"
    return m.group(1)


def _code_blocks(text: str) -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)


def test_readme_is_a_front_page():
    n = len(_readme().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail to docs/ (at most {MAX_README_LINES})"


def test_readme_paths_exist():
    text = _readme()
    named = set(re.findall(r"\]\(((?:docs|bench|notebooks|tests|kvforge)/[^)#\s]*)", text))
    named |= set(re.findall(r"`((?:docs|notebooks)/[\w./-]+\.(?:md|ipynb))`", text))
    assert named, "the README links no docs"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def _env_vars_in_source() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "kvforge").rglob("*.py"):
        found |= set(re.findall(r"\bKVFORGE_[A-Z0-9_]+", path.read_text(encoding="utf-8")))
    return found


def test_every_kvforge_variable_is_in_the_readme_table():
    table = _section(_readme(), "Environment variables")
    rows = [line for line in table.splitlines() if line.startswith("|")]
    listed = {v for line in rows for v in re.findall(r"`(KVFORGE_[A-Z0-9_]+)`", line.split("|")[1])}
    used = _env_vars_in_source()
    assert "KVFORGE_DECODE_TRIAL" in used  # the scan sees the variable issue 32 found missing
    missing = sorted(used - listed)
    assert not missing, f"KVFORGE_* variables read in kvforge/ but not in the README's table: {missing}"
    stale = sorted(listed - used)
    assert not stale, f"README table lists variables nothing in kvforge/ reads: {stale}"


def _ci_lines() -> list[str]:
    return [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]


def test_readme_commands_match_ci():
    blocks = _code_blocks(_section(_readme(), "On a fresh machine"))
    commands = [line.strip() for b in blocks for line in b.splitlines() if line.strip()]
    ci = _ci_lines()
    # The test command: the same line in both.
    ci_test = [line for line in ci if line.startswith("python3 -m pytest")]
    assert len(ci_test) == 1, ci_test
    assert ci_test[0] in commands, f"README's test command differs from .ci/run's {ci_test[0]!r}"
    # The install: the same torch pin (the README adds PyTorch's CPU index) and at least CI's extras.
    install = next(c for c in commands if "pip install" in c and "torch==" in c)
    ci_torch = next(line for line in ci if "pip install" in line and "torch==" in line)
    pin = re.search(r"torch==[\w.+]+", ci_torch).group(0)  # type: ignore[union-attr]
    assert pin in install, (pin, install)
    assert "--index-url https://download.pytorch.org/whl/cpu" in install
    ci_extras = set(re.search(r'-e "\.\[([\w,]+)\]"', " ".join(ci)).group(1).split(","))  # type: ignore[union-attr]
    readme_extras = set(re.search(r'-e "\.\[([\w,]+)\]"', install).group(1).split(","))  # type: ignore[union-attr]
    assert ci_extras <= readme_extras, (ci_extras, readme_extras)
    assert install.rstrip().endswith("python3 -m kvforge"), "the install command ends by running the main job"


# --- import cycles ---------------------------------------------------------------------------------------------------


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "kvforge").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run when the module is imported: the body, top-level if/try/with included."""
    out: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                out += _module_level_imports(node.body)
            out += _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for part in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                out += _module_level_imports(part)
        elif isinstance(node, ast.With):
            out += _module_level_imports(node.body)
    return out


def _runtime_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level and deferred (inside functions); only
    ``if TYPE_CHECKING:`` blocks are left out, since they never run."""
    out: list[ast.Import | ast.ImportFrom] = []

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if _is_type_checking(node.test):
                for n in node.orelse:
                    self.visit(n)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            out.append(node)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            out.append(node)

    Visitor().visit(tree)
    return out


def import_graph(*, deferred: bool = False) -> dict[str, set[str]]:
    """Module -> the kvforge modules its imports load: module-level imports, and with ``deferred`` also those
    inside functions. A package's ``__init__`` counts only when it is imported itself or a name is taken from
    it, not as the parent of a submodule (a package importing its own submodules is no circle)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        deps: set[str] = set()
        for node in _runtime_imports(tree) if deferred else _module_level_imports(tree.body):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
                continue
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            for a in node.names:
                sub = f"{mod}.{a.name}"
                if sub in modules:
                    deps.add(sub)
                elif mod in modules:
                    deps.add(mod)
        deps.discard(name)
        graph[name] = deps
    return graph


def test_import_graph_sees_relative_conditional_and_deferred_imports():
    src = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\ntry:\n    import b\nexcept ImportError:\n"
        "    import c\ndef f():\n    import d\n"
    )
    tree = ast.parse(src)
    assert [a.name for n in _module_level_imports(tree.body) for a in n.names] == ["TYPE_CHECKING", "b", "c"]
    assert [a.name for n in _runtime_imports(tree) for a in n.names] == ["TYPE_CHECKING", "b", "c", "d"]
    graph = import_graph()
    assert "kvforge.kvcache.manager" in graph["kvforge.kvcache.replay"]  # an absolute import
    assert len(graph) > 50
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]


def test_no_import_cycle_in_kvforge_at_import_time():
    cycles = _cycles(import_graph())
    assert cycles == [], f"module-level import cycles in kvforge/: {cycles}"


def test_no_import_cycle_in_kvforge_including_deferred_imports():
    """A function-level import that closes a circle only hides it (issue 32: engine config <-> planted <->
    model, kernels mla_decode <-> mla_decode_gluon)."""
    cycles = _cycles(import_graph(deferred=True))
    assert cycles == [], f"import cycles in kvforge/ (deferred imports included): {cycles}"


# --- the self-check table says what its notes say (issue 32, item 8) ------------------------------------------------


def test_selfcheck_decode_rows_name_relative_rmse_as_their_unit():
    import torch

    import kvforge.kernels  # noqa: F401  (interpreter on without a GPU)
    from kvforge.kernels import mla_decode
    from kvforge.kernels._selfcheck import format_table

    rows = mla_decode.selfcheck(torch.device("cpu"))
    assert rows and all(r.op == "mla_decode_attention" for r in rows)
    for r in rows:
        assert r.passed, r
        assert r.unit == "rel RMSE", r.unit  # the error is the output's RMS error over the reference's RMS
        assert "abs" not in r.note and "RMSE" not in r.note, r.note  # the unit column says it, not a note
        assert 0 < r.max_err < 1e-1, r.max_err
    table = format_table(rows).splitlines()
    assert all("rel RMSE" in line for line in table[2:])
