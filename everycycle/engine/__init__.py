"""llama.cpp: executors and placement (executors.py), the batched runner (runner.py),
GGUF metadata (gguf.py). Knows nothing of sockets, clients or the registry."""
