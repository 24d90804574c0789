"""MCP servers' tools for a pod (SPEC §3 `[[mcp.servers]]`).

Importing this package imports neither the `mcp` SDK nor the client: `start_mcp` imports the
client when the manifest lists servers, and the SDK (in a thread) when a server needs it.
"""

from poddaemon.mcp.manager import McpManager, McpStartupError, preload_sdk, start_mcp

__all__ = ["McpManager", "McpStartupError", "preload_sdk", "start_mcp"]
