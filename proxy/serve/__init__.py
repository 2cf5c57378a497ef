"""The HTTP face: app wiring, routes, tenants, the handler (the straight line), the one upstream
client, relay, admin API, access log."""
