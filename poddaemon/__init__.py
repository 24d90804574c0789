"""poddaemon: LLM agents as supervised OS processes."""

__version__ = "0.1.0"
