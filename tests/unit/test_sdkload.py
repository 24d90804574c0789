"""The deferred SDK import (poddaemon/llm/sdkload.py): a package's `__init__` runs only when an
attribute needs it, and a deferred package answers as the real one would."""

import itertools
import json
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from poddaemon.llm.sdkload import deferred, load_sdk

_names = itertools.count()

INIT = """\
from . import _client
from ._client import Client, Timeout as PublicTimeout
from ._models import Model
from .heavy import Big
from ._client import Rebound
Rebound = None
VERSION = "1.2"
import json as _json
"""


@pytest.fixture
def make_sdk(tmp_path: Path) -> Iterator[Callable[[], str]]:
    """A throwaway SDK-shaped package on sys.path: `__init__` imports a heavy module and binds
    names from submodules; `types/` is a subpackage whose `__init__` imports all its models."""
    made: list[str] = []

    def make() -> str:
        name = f"fake_sdk_{next(_names)}"
        root = tmp_path / name
        (root / "types").mkdir(parents=True)
        (root / "__init__.py").write_text(INIT)
        (root / "_client.py").write_text(
            "from .types.one import One\nclass Client: pass\nclass Timeout: pass\nRebound = 1\n"
        )
        (root / "_models.py").write_text("class Model: pass\n")
        (root / "heavy.py").write_text("class Big: pass\n")
        (root / "types" / "__init__.py").write_text("from .one import One\nfrom .two import Two\n")
        (root / "types" / "one.py").write_text("class One: pass\n")
        (root / "types" / "two.py").write_text("class Two: pass\n")
        made.append(name)
        return name

    sys.path.insert(0, str(tmp_path))
    yield make
    sys.path.remove(str(tmp_path))
    for name in made:
        for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[mod]


def loaded(name: str) -> set[str]:
    return {m for m in sys.modules if m == name or m.startswith(name + ".")}


def test_importing_a_submodule_does_not_run_the_packages_init(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    sdk = load_sdk(name)
    assert deferred(sdk)
    assert loaded(name) == {name}
    client = __import__(f"{name}._client", fromlist=["Client"])
    # _client imports types.one: the types package is made, its __init__ (importing two) is not
    assert loaded(name) == {name, f"{name}._client", f"{name}.types", f"{name}.types.one"}
    assert deferred(sdk) and deferred(sys.modules[f"{name}.types"])
    assert client.Client.__module__ == f"{name}._client"


def test_a_name_init_imports_is_the_same_object_without_running_init(
    make_sdk: Callable[[], str],
) -> None:
    name = make_sdk()
    sdk = load_sdk(name)
    client = sys.modules.get(f"{name}._client") or __import__(f"{name}._client", fromlist=["x"])
    assert sdk.Client is client.Client
    assert sdk.PublicTimeout is client.Timeout  # `import a as b`
    assert sdk._client is client  # a submodule
    assert deferred(sdk)
    assert f"{name}.heavy" not in sys.modules and f"{name}._models" not in sys.modules


def test_from_import_of_a_public_name_does_not_run_init(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    load_sdk(name)
    ns: dict[str, object] = {}
    exec(f"from {name} import Client, Model", ns)
    assert type(ns["Client"]) is type and type(ns["Model"]) is type
    assert deferred(sys.modules[name]) and f"{name}.heavy" not in sys.modules


def test_anything_else_runs_the_real_init_once(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    sdk = load_sdk(name)
    client = sdk.Client
    assert sdk.VERSION == "1.2"  # computed by __init__: it runs, in place
    assert not deferred(sdk)
    assert f"{name}.heavy" in sys.modules  # everything __init__ imports is there now
    assert sdk.Client is client and sdk.Big.__name__ == "Big"
    assert sdk._json is json
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _ = sdk.nothing


def test_a_name_init_rebinds_comes_from_the_real_init(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    sdk = load_sdk(name)
    assert sdk.Rebound is None  # imported, then assigned: the import alone would say 1
    assert not deferred(sdk)


def test_dunder_names_and_star_imports_run_the_real_init(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    load_sdk(name)
    ns: dict[str, object] = {}
    exec(f"from {name} import *", ns)
    assert ns["VERSION"] == "1.2" and not deferred(sys.modules[name])


def test_an_unknown_name_is_an_attribute_error_after_init(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    sdk = load_sdk(name)
    assert not hasattr(sdk, "missing")
    assert not deferred(sdk)  # the real __init__ was the last word on it


def test_a_thread_asking_while_init_runs_waits_for_it(make_sdk: Callable[[], str]) -> None:
    """While one thread runs the real `__init__`, another asking for a name it binds waits and
    gets it (it must not see the package half made), and `__init__` runs once."""
    name = make_sdk()
    gate = ModuleType("_sdkload_gate")
    gate.started, gate.release, gate.runs = threading.Event(), threading.Event(), []  # type: ignore[attr-defined]
    sys.modules["_sdkload_gate"] = gate
    Path(sys.path[0], name, "__init__.py").write_text(
        "import _sdkload_gate as g\ng.runs.append(1)\ng.started.set()\ng.release.wait(10)\n" + INIT
    )
    sdk = load_sdk(name)
    got: dict[str, object] = {}

    def ask(who: str) -> None:
        try:
            got[who] = sdk.VERSION
        except AttributeError as exc:
            got[who] = exc

    try:
        first = threading.Thread(target=ask, args=("first",))
        first.start()
        assert gate.started.wait(10)  # type: ignore[attr-defined]
        second = threading.Thread(target=ask, args=("second",))
        second.start()
        second.join(0.2)
        assert "second" not in got  # waiting for __init__, not failed
        gate.release.set()  # type: ignore[attr-defined]
        first.join(10)
        second.join(10)
    finally:
        gate.release.set()  # type: ignore[attr-defined]
        del sys.modules["_sdkload_gate"]
    assert got == {"first": "1.2", "second": "1.2"}
    assert gate.runs == [1]  # type: ignore[attr-defined]
    assert not deferred(sdk) and "__getattr__" not in vars(sdk)


def test_an_already_imported_package_stays_as_it_is(make_sdk: Callable[[], str]) -> None:
    name = make_sdk()
    real = __import__(name)
    assert load_sdk(name) is real and not deferred(real)


def _in_fresh_python(code: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize(
    ("package", "client"),
    [
        ("openai", "AsyncOpenAI(api_key='k', base_url='http://127.0.0.1:9/v1')"),
        ("anthropic", "AsyncAnthropic(api_key='k', base_url='http://127.0.0.1:9')"),
    ],
)
def test_the_real_sdks_build_a_client_with_a_fraction_of_their_modules(
    package: str, client: str
) -> None:
    """The installed SDKs: what an adapter uses (the client, AsyncStream, Timeout) comes
    without the package's `__init__`, in a fraction of the modules `import <sdk>` loads; the
    package still answers anything else (its version, here) by running it."""
    count = f"sum(m.split('.')[0] == '{package}' for m in sys.modules)"
    lean = _in_fresh_python(f"""
        import json, sys
        from poddaemon.llm.sdkload import deferred, load_sdk
        sdk = load_sdk("{package}")
        sdk.{client}
        from {package} import AsyncStream
        sdk.Timeout(5.0, connect=1.0)
        modules, still = {count}, deferred(sdk)
        print(json.dumps({{"modules": modules, "deferred": still, "v": sdk.__version__}}))
    """)
    plain = _in_fresh_python(f"""
        import json, sys
        import {package}
        {package}.{client}
        print(json.dumps({{"modules": {count}, "v": {package}.__version__}}))
    """)
    assert lean["deferred"] is True
    assert lean["v"] == plain["v"]
    modules, all_modules = lean["modules"], plain["modules"]
    assert isinstance(modules, int) and isinstance(all_modules, int)
    assert modules * 2 < all_modules, (lean, plain)  # openai: 38 of 520; anthropic: 942 of 2,932


def test_with_the_sdks_log_variable_set_the_package_is_imported_whole(
    make_sdk: Callable[[], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`OPENAI_LOG=debug`: the SDK's `__init__` sets its logging up, so it runs."""
    name = make_sdk()
    monkeypatch.setenv(f"{name.upper()}_LOG", "debug")
    sdk = load_sdk(name)
    assert not deferred(sdk) and sdk.VERSION == "1.2" and f"{name}.heavy" in sys.modules
