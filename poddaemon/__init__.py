"""poddaemon: LLM agents as supervised OS processes."""

__version__ = "0.1.0"


def version_line(program: str) -> str:
    """What `podctl --version` and `poddaemon --version` print."""
    from protocol import PROTOCOL_VERSION

    return f"{program} {__version__} (protocol {PROTOCOL_VERSION})"
