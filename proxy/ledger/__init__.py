"""The ledger: prices (pricing), the store protocol (store: the per-call Ledger and the read
and admin Views), its backends (sqlite; redis with its Lua scripts in lua/, its pipelined
connection in redis_pipe and the key-layout migration in redis_migrate; chosen by URL in
backends, wrapped by failopen when the operator allows it), rate limits (rates), refusal
messages (messages) and where a call's input went (anatomy).
"""
