"""`--set section.key=value`: the one rule for its shape, shared by podctl (a malformed one is a
usage error before any pod starts) and the manifest loader (which applies it). No heavy imports."""

import re

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")  # a TOML bare key: one part of the dotted path


def split_override(text: str) -> tuple[list[str], str] | None:
    """The key path and the raw value of `section.key=value`; None when `text` is not one."""
    dotted, sep, raw = text.partition("=")
    parts = dotted.strip().split(".")
    if not sep or not all(_BARE_KEY.fullmatch(p) for p in parts):
        return None
    return parts, raw
