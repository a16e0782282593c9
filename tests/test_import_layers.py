"""Import hygiene: the pure-Python layers load without torch, triton or the kernels, and `kvforge.kernels`
re-exports its public ops lazily (the same objects as in their modules)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["kvforge", "kvforge.kvcache", "kvforge.routing", "kvforge.scheduling"])
def test_pure_layers_do_not_import_torch_or_kernels(module: str):
    code = (
        f"import sys, {module}\n"
        "bad = sorted(m for m in sys.modules if m in ('torch', 'triton') or m.startswith('kvforge.kernels'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_kernels_package_loads_no_op_module_until_used():
    code = (
        "import sys, kvforge.kernels as k\n"
        "print(','.join(sorted(m for m in sys.modules if m.startswith('kvforge.kernels.') and m != "
        "'kvforge.kernels._runtime')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""


def test_kernels_reexports_are_the_module_objects():
    import kvforge.kernels as k

    for name, module in k._LAZY.items():
        assert getattr(k, name) is getattr(importlib.import_module(f"kvforge.kernels.{module}"), name)
    assert set(k._LAZY) <= set(k.__all__) and set(k._LAZY) <= set(dir(k))
    with pytest.raises(AttributeError):
        k.no_such_op  # noqa: B018


def _package_imports(package: str) -> dict[str, set[str]]:
    """Module -> modules of ``package`` it imports, from the source: every import statement counts, including
    those under ``TYPE_CHECKING`` and inside functions (a loop there is still a loop in the design)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    pkg_dir = root / package.replace(".", "/")
    modules = {}
    for f in pkg_dir.rglob("*.py"):
        parts = f.relative_to(pkg_dir).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            if not parts:
                continue  # the package's own __init__ only re-exports
        modules[".".join((package, *parts))] = f
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps.update(t for t in targets if t in modules and t != name)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize(
    "package", ["kvforge.kvcache", "kvforge.scheduling", "kvforge.routing", "kvforge.sim", "kvforge.engine"]
)
def test_no_import_loop_inside_a_package(package: str):
    graph = _package_imports(package)
    assert len(graph) > 3
    assert _cycles(graph) == []
