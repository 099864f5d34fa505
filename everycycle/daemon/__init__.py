"""The daemon: listeners and framing (server.py), admission and queues (supervisor.py),
the audit log (audit.py). Imports the engine and the models layer, never the clients."""
