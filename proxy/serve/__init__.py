"""The HTTP face of a model call: routes, tenants, the handler (the straight line), the one
upstream client, the relay, the admin API, the access log, the bookkeeping after the answer."""
