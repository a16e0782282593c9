"""Import a few pure-Python modules of a peer (vLLM, SGLang) straight from its published wheel, unmodified.

:func:`install` puts a finder on ``sys.meta_path`` for one top-level package: the modules named in ``real`` are
executed from the wheel's own source (read from the zip; nothing is installed or extracted), their parent
packages are empty namespaces (so the peer's ``__init__`` with its GPU imports never runs), and every other module
of that package is a stub whose attributes are permissive placeholder classes. ``overrides`` pins a stub
module's attribute to a given value where a placeholder would change behaviour (a logger, a constant, a helper).
The bench checks the peers' results against kvforge's (hit counts) so a stub that changed behaviour would show.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import zipfile
from abc import ABCMeta
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class _StubMeta(ABCMeta):
    """Placeholder classes: any class attribute is another placeholder; ``X[int]`` and ``X | None`` are X."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _stub_class(f"{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    def __ror__(cls, other: Any) -> Any:
        return cls


def _stub_class(name: str) -> type:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self: Any, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _noop

    return _StubMeta(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "__getattr__": __getattr__})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, finder: _WheelFinder, kind: str) -> None:
        self.finder = finder
        self.kind = kind

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        if self.kind == "stub":
            return _StubModule(spec.name)
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        for attr, value in self.finder.overrides.get(name, {}).items():
            setattr(module, attr, value)
        if self.kind != "real":
            return
        path = name.replace(".", "/") + ".py"
        source = self.finder.zip.read(path).decode()
        module.__file__ = f"{self.finder.wheel}!/{path}"
        exec(compile(source, module.__file__, "exec"), module.__dict__)


class _WheelFinder(importlib.abc.MetaPathFinder):
    def __init__(self, wheel: Path, top: str, real: Sequence[str], overrides: Mapping[str, Mapping[str, Any]]):
        self.wheel = wheel
        self.zip = zipfile.ZipFile(wheel)
        self.top = top
        self.real = set(real)
        self.overrides = {k: dict(v) for k, v in overrides.items()}
        self.packages = {".".join(m.split(".")[:i]) for m in self.real for i in range(1, m.count(".") + 1)}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname.split(".")[0] != self.top:
            return None
        if fullname in self.real:
            kind = "real"
        elif fullname in self.packages:
            kind = "package"
        else:
            kind = "stub"
        spec = importlib.machinery.ModuleSpec(fullname, _Loader(self, kind), is_package=kind != "real")
        if kind != "real":
            spec.submodule_search_locations = []
        return spec


def install(
    wheel: Path, top: str, real: Sequence[str], overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> None:
    """Serve ``top``'s modules from ``wheel`` as described in the module docstring (idempotent per ``top``)."""
    for f in sys.meta_path:
        if isinstance(f, _WheelFinder) and f.top == top:
            return
    sys.meta_path.insert(0, _WheelFinder(wheel, top, real, overrides or {}))


def stub_module(name: str, **attrs: Any) -> types.ModuleType:
    """A placeholder third-party module (e.g. ``cbor2``, which vLLM imports but the bench never calls)."""
    mod = _StubModule(name)
    for k, v in attrs.items():
        setattr(mod, k, v)
    sys.modules.setdefault(name, mod)
    return sys.modules[name]


def find_wheel(folder: Path, dist: str) -> Path | None:
    """The newest-named ``<dist>-*.whl`` in ``folder`` (None when there is none)."""
    found = sorted(folder.glob(f"{dist}-*.whl")) if folder.is_dir() else []
    return found[-1] if found else None
