"""What a stdio MCP server's environment is: the few basics the MCP SDK passes by default, plus
the manifest's `env` with `${VAR}` expanded from the pod's environment. Nothing else of the pod's
environment (API keys included) reaches a server."""

import re
from collections.abc import Mapping

# The MCP SDK's own default (mcp.client.stdio.DEFAULT_INHERITED_ENV_VARS on POSIX); repeated here
# so the server can be spawned before the SDK is imported (start-up runs both in parallel).
INHERITED = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER")

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class EnvError(ValueError):
    """An `env` value names a variable the pod's environment does not have."""

    def __init__(self, key: str, var: str) -> None:
        super().__init__(f"env.{key}: ${{{var}}} is not set in the pod's environment")
        self.key = key
        self.var = var


def expand(value: str, environ: Mapping[str, str], key: str = "") -> str:
    """`value` with every `${VAR}` replaced by its value in `environ`; unset is an EnvError."""

    def sub(m: re.Match[str]) -> str:
        found = environ.get(m[1])
        if found is None:
            raise EnvError(key, m[1])
        return found

    return _VAR.sub(sub, value)


def referenced(env: Mapping[str, str]) -> list[str]:
    """The names of the pod's variables that `env` hands to a server (its `${VAR}`s)."""
    return [m[1] for value in env.values() for m in _VAR.finditer(value)]


def server_env(env: Mapping[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The whole environment of a stdio server: the inherited basics, then `env` expanded."""
    out = {
        k: v
        for k in INHERITED
        # Exported shell functions are code, not configuration: the SDK skips them too.
        if (v := environ.get(k)) is not None and not v.startswith("()")
    }
    for key, value in env.items():
        out[key] = expand(value, environ, key)
    return out
