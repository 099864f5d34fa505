"""An MCP server (stdio) whose one tool exits the server in the middle of the call: how
the chat meets a server that crashes (tests/test_chat_tools.py)."""

import os

from mcp.server.mcpserver import MCPServer

server = MCPServer("crasher")


@server.tool()
def crash(why: str = "") -> str:
    """Exit this server's process while the call runs."""
    os._exit(3)


if __name__ == "__main__":
    server.run()
