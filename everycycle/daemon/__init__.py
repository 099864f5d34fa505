"""The daemon: serves the protocol (socket and HTTP) over the engines. Imports the
engine, chatfmt, hardware and the models layer, never the clients.

server.py      listeners, NDJSON framing, one task group per connection, shutdown
connection.py  the sans-IO ServerConnection: framing, decoding, auth, per connection
supervisor.py  admission and limits; coordinates the parts below
lifecycle.py   active requests, each model's lane, queue positions, cancels, deadlines,
               the one terminal event
residency/     the resident models and the room they need: loading, unloading, idle
               unloading, engine deaths and restarts; evictions, waits for busy models,
               allocation retries; RPC hosts' devices and the order of executors
jobbuild.py    a request's Job: tokens, sampling, grammar, and how its output is split
fleet.py       the live FleetSnapshot; hardware queried off the event loop
outcome.py     admission Limits, the Peer contract, each generation's Outcome
handoff.py     decode threads' outputs handed to the event loop
audit.py       the append-only JSONL audit log
keys.py        API keys: principals and their limits
quota.py       rate limits per principal (token buckets)
usage.py       usage reports summed from the audit log
metrics.py     Prometheus metrics
httpserver.py  uvicorn run inside the daemon's event loop, with bounds on clients
http/          the HTTP API: one exchange with the supervisor, one module per dialect
"""
