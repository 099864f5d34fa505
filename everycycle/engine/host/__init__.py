"""Where an engine runs: the ``Engine`` contract the supervisor depends on and the pipe's
messages (``contract``), the daemon's proxy for an engine process (``process``), and
that process (``child``: ``python -m everycycle.engine.host.child``)."""
