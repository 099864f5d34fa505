"""llama.cpp itself: a GGUF loaded and its context (``llamaload``), its process-wide set-up
and log (``llamalog``), the vocabulary (``vocab``), and the load-time probes."""
