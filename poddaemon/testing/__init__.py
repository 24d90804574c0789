"""Test helpers shipped with poddaemon (the fake model server: `poddaemon.testing.fake_model`).

`FakeModel` is imported lazily so `python -m poddaemon.testing.fake_model` runs cleanly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from poddaemon.testing.fake_model import FakeModel

__all__ = ["FakeModel"]


def __getattr__(name: str) -> Any:
    if name == "FakeModel":
        from poddaemon.testing.fake_model import FakeModel

        return FakeModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
