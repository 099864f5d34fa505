"""The user's MCP servers: ``mcp.json`` (``config``) and running them for the daemon
(``host``). The loop a chat runs with their tools, asking its user before each call, is
the CLI's (``cli/toolloop.py``) and the console's (``webconsole/chat.js``)."""
