"""Start-up checks of a provider's `base_url`: warnings for the pod to print and publish as an
alert, never failures (the model server may well start after the pod).

Only what is clearly wrong is reported. OpenAI-compatible servers put their API under many
paths (`/v1`, `/api/v1`, `/openai/v1`, a bare host), so a path is questioned only when it names
an endpoint the SDK appends itself, doubles `/v1`, or is the bare root of a local server (where
`podctl dev fake-model`, Ollama, vLLM and LM Studio all serve under `/v1`). A local server
(loopback address) is also tried with one TCP connect; remote ones are left alone: no network
traffic at start-up beyond this machine.
"""

import ipaddress
import socket
from urllib.parse import SplitResult, urlsplit

__all__ = [
    "CONNECT_TIMEOUT",
    "OPENAI_MAX_TOOLS",
    "base_url_problems",
    "is_local",
    "local_unreachable",
    "preflight",
    "too_many_tools",
]

CONNECT_TIMEOUT = 0.5  # seconds; a loopback connect answers in microseconds or is refused
OPENAI_MAX_TOOLS = 128  # OpenAI refuses a request offering more (400 array_above_max_length)

OPENAI_KINDS = ("openai", "openai_responses")
# Endpoint paths the SDKs append to base_url themselves.
ENDPOINTS = {
    "openai": ("/chat/completions", "/completions", "/responses"),
    "openai_responses": ("/responses", "/chat/completions", "/completions"),
    "anthropic": ("/messages",),
}


def _split(base_url: str) -> SplitResult | None:
    """`base_url`'s parts; None when urlsplit refuses it (`http://[::1`: "Invalid IPv6 URL"),
    which was a traceback ending the pod's start-up instead of a warning."""
    try:
        return urlsplit(base_url)
    except ValueError:
        return None


def _root(parts: SplitResult) -> str:
    return f"{parts.scheme}://{parts.netloc}"


def is_local(host: str) -> bool:
    """A loopback name or address: something this machine has to be running."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(
        ".localhost"
    ):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def base_url_problems(
    kind: str, base_url: str | None, field: str = "provider.base_url"
) -> list[str]:
    """What is clearly wrong with `base_url` for a provider of `kind` (no I/O)."""
    if not base_url:
        return []
    parts = _split(base_url)
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return [f"{field} {base_url!r} is not an http(s) URL"]
    path = parts.path.rstrip("/")
    for endpoint in ENDPOINTS.get(kind, ()):
        if path.endswith(endpoint):
            fixed = _root(parts) + path[: -len(endpoint)]
            return [
                f"{field} {base_url!r} ends in the endpoint {endpoint}, which the SDK adds "
                f"itself: use {fixed!r}"
            ]
    if kind in OPENAI_KINDS:
        if path.endswith("/v1/v1"):
            return [f"{field} {base_url!r} has /v1 twice: use {_root(parts) + path[:-3]!r}"]
        if not path and is_local(parts.hostname):
            return [
                f"{field} {base_url!r} has no path, but local OpenAI-compatible servers "
                f"(podctl dev fake-model, Ollama, vLLM) serve under /v1: "
                f"use {_root(parts) + '/v1'!r} unless yours really answers at the root"
            ]
    elif kind == "anthropic" and path.endswith("/v1/v1"):
        return [
            f"{field} {base_url!r} has /v1 twice (the SDK adds /v1 itself): "
            f"use {_root(parts) + path[:-6]!r}"
        ]
    return []


def local_unreachable(
    base_url: str | None, timeout: float = CONNECT_TIMEOUT, field: str = "provider.base_url"
) -> str | None:
    """Why a local `base_url` does not answer a TCP connect; None when it does, or when it is
    not local (or not a URL at all: base_url_problems says so)."""
    if not base_url:
        return None
    parts = _split(base_url)
    if parts is None:
        return None  # (base_url_problems says so)
    host = parts.hostname
    if parts.scheme not in ("http", "https") or not host or not is_local(host):
        return None
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"{field} {base_url!r} has an invalid port"
    try:
        # An ASCII host as bytes: a str one makes getaddrinfo import the idna codec (~1.5 ms).
        address = (host.encode() if host.isascii() else host, port)
        with socket.create_connection(address, timeout=timeout):  # type: ignore[arg-type]
            return None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        return (
            f"{field} {base_url!r}: nothing answers at {host}:{port} ({reason}); "
            "runs fail until the server is up"
        )


def preflight(
    kind: str,
    base_url: str | None,
    timeout: float = CONNECT_TIMEOUT,
    field: str = "provider.base_url",
) -> list[str]:
    """Every start-up warning about this provider endpoint. Blocks up to `timeout` seconds for a
    local connect: call it off the event loop (`asyncio.to_thread`)."""
    warnings = base_url_problems(kind, base_url, field)
    unreachable = local_unreachable(base_url, timeout, field)
    if unreachable is not None:
        warnings.append(unreachable)
    return warnings


def too_many_tools(kind: str, count: int) -> str | None:
    """A warning when the model is offered more tools than OpenAI's API takes in one request:
    it refuses every call then. Not an error: an OpenAI-compatible server may take them."""
    if kind not in OPENAI_KINDS or count <= OPENAI_MAX_TOOLS:
        return None
    return (
        f"{count} tools are offered to the model, but OpenAI's API refuses a request with more "
        f"than {OPENAI_MAX_TOOLS}: every model call will fail there; offer fewer (worker.tools, "
        "or an MCP server's tools = [...] allow-list)"
    )
