"""The MCP route and its wire format."""
