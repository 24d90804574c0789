"""Finds this checkout's packages for the repo's own .venv (`make install` runs it from a .pth
line at every interpreter start).

Not setuptools' editable finder (~20 ms at every start of podctl and of a pod), and not the
checkout itself on sys.path: a command confined by the sandbox may not list the checkout, only
read the packages' own directories, so the packages are located by name, without listing."""

import os
import sys
from importlib.machinery import ModuleSpec, SourceFileLoader  # loaded at start-up already

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = frozenset({"poddaemon", "cli", "protocol"})


class RepoFinder:
    @classmethod
    def find_spec(cls, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if name not in _PACKAGES:
            return None
        package = os.path.join(_ROOT, name)
        init = os.path.join(package, "__init__.py")
        spec = ModuleSpec(name, SourceFileLoader(name, init), origin=init, is_package=True)
        spec.submodule_search_locations = [package]
        spec.has_location = True
        return spec


if RepoFinder not in sys.meta_path:
    sys.meta_path.insert(0, RepoFinder)  # first: a `poddaemon/` in the cwd never shadows ours
