"""Import a provider SDK without the hundreds of response types its package imports.

`import openai` runs `openai/__init__.py`, which imports every model of the API: 520 modules
and 23 MB of heap where the client alone needs 38 and 12 MB (anthropic: 46 MB, 21 needed). A
pod never uses the models: the adapters send plain JSON and read the stream as decoded JSON.
`load_sdk("openai")` imports the same package with every `__init__` under it deferred:

- the package module is made as usual (`__path__`, `__file__`, ...) but its `__init__` does not
  run, so importing a submodule (`openai._client`) loads that submodule and what it imports,
  nothing else;
- a missing attribute is fetched the way `__init__` would bind it: a submodule is imported; a
  name that `__init__` binds with a top-level `from .x import name` is taken from `.x` (the
  same object `__init__` would bind: `openai.AsyncOpenAI` is `openai._client.AsyncOpenAI`);
- any other attribute (`__version__`, `__all__`, a name `__init__` computes) runs the real
  `__init__` in place first. So a deferred package behaves as the real one; at worst it costs
  what the plain import costs.

What `__init__` does beyond binding names does not happen until then: openai's and anthropic's
rename their public classes' `__module__` for nicer reprs, and read `OPENAI_LOG` /
`ANTHROPIC_LOG` to switch their own logging on; with that variable set the SDK is imported whole,
as someone debugging it expects.

The deferral covers packages imported after `load_sdk` under the SDK's top-level name only, and
only packages found on the ordinary path (an SDK installed some other way imports as usual).
"""

import importlib
import importlib.machinery
import os
import sys
import threading
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_lock = threading.Lock()


def load_sdk(package: str) -> ModuleType:
    """`importlib.import_module(package)` with the package's `__init__` files deferred (see the
    module's docstring). A package already imported stays as it is, and with `<PACKAGE>_LOG` set
    (the SDK's own debug logging, set up by its `__init__`) the package is imported whole."""
    if os.environ.get(f"{package.upper()}_LOG"):
        return importlib.import_module(package)
    with _lock:
        _finder.roots.add(package)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
    return importlib.import_module(package)


def deferred(module: ModuleType) -> bool:
    """True while `module`'s `__init__` has not run (for the tests)."""
    loader = getattr(module.__spec__, "loader", None)
    return isinstance(loader, _DeferredInit) and not loader.ran


class _Finder:  # a meta path finder (importlib.abc is not imported: ~7 ms at start)
    def __init__(self) -> None:
        self.roots: set[str] = set()

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] not in self.roots:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.submodule_search_locations is None or spec.origin is None:
            return None  # a plain module, or not ours to find: the other finders decide
        if not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return None
        spec.loader = _DeferredInit(spec.loader)  # type: ignore[assignment]
        return spec


class _DeferredInit:  # a loader
    """Loads a package without running its `__init__` until an attribute needs it."""

    def __init__(self, real: importlib.machinery.SourceFileLoader) -> None:
        self.real = real
        self.ran = False
        self._init_lock = threading.RLock()  # RLock: the real __init__'s imports come back here
        self._hook: Any = None
        self._bindings: dict[str, tuple[str, str]] | None = None

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...: the real
        return getattr(self.real, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        self._hook = lambda name: self._resolve(module, name)
        module.__getattr__ = self._hook  # type: ignore[method-assign]

    def _resolve(self, module: ModuleType, name: str) -> Any:
        fullname = module.__name__
        if not self.ran and not name.startswith("__"):
            if importlib.machinery.PathFinder.find_spec(f"{fullname}.{name}", module.__path__):
                return importlib.import_module(f"{fullname}.{name}")
            source, attr = self._bound_by_init().get(name, ("", ""))
            if source:
                value = getattr(importlib.import_module(source, fullname), attr)
                setattr(module, name, value)
                return value
        # The real __init__ runs once, with the hook still in place: a thread asking meanwhile
        # waits here for it to finish (without the hook it would find the names missing).
        with self._init_lock:
            if not self.ran:
                self.ran = True
                self.real.exec_module(module)
                if module.__dict__.get("__getattr__") is self._hook:  # not one __init__ set
                    del module.__getattr__
        try:
            return module.__dict__[name]
        except KeyError:
            raise AttributeError(f"module {fullname!r} has no attribute {name!r}") from None

    def _bound_by_init(self) -> dict[str, tuple[str, str]]:
        """name -> (relative module, attribute) for each name the package's `__init__` binds
        only by a top-level `from .x import a as name` (a name it also assigns, defines or
        imports otherwise is left to the real `__init__`)."""
        if self._bindings is None:
            import ast  # here: only an SDK's load needs it

            imported: dict[str, tuple[str, str]] = {}
            other: set[str] = set()
            for node in ast.parse(self.real.get_data(self.real.path)).body:
                if isinstance(node, ast.ImportFrom) and node.level and node.module:
                    for alias in node.names:
                        imported[alias.asname or alias.name] = (
                            "." * node.level + node.module,
                            alias.name,
                        )
                else:  # anything else that binds a name, at any depth
                    for n in ast.walk(node):
                        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
                            other.add(n.id)
                        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                            other.add(n.name)
                        elif isinstance(n, ast.Import | ast.ImportFrom):
                            other.update((a.asname or a.name).partition(".")[0] for a in n.names)
            self._bindings = {k: v for k, v in imported.items() if k not in other and k != "*"}
        return self._bindings


_finder = _Finder()
