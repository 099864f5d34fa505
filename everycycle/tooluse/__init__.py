"""Tools in chat: the user's MCP servers (``mcp.json``), run by the daemon
(``host``), and the loop a chat runs with them, asking its user before each call
(``loop``)."""
