"""MCP servers' tools for a pod (SPEC §3 `[[mcp.servers]]`).

Importing this package does not import the `mcp` SDK: `start_mcp` imports it (in a thread) only
when the manifest lists servers.
"""

from poddaemon.mcp.connection import McpServerStatus
from poddaemon.mcp.manager import McpManager, McpStartupError, preload_sdk, start_mcp

__all__ = ["McpManager", "McpServerStatus", "McpStartupError", "preload_sdk", "start_mcp"]
