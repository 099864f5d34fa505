"""Hardware: what this machine (and its RPC hosts) can run, and where a model fits.
Imports only the ground, never the engine or the daemon; the daemon asks it without
loading a model, the engine loads models where it says.

executors.py   the ggml backends of this llama.cpp build, their devices and memory
               (discovery through ggml's own registry), and placement on them
memory.py      what a model will need before it loads: weights per layer and its KV cache;
               the fit of layers to devices
gguf.py        a GGUF file's header read by hand: metadata and where its tensors lie
ggufwrite.py   small random-weight GGUFs written with the ``gguf`` package (the CPU-kernel
               probe's model, the tests' tiny models)
cpukernels.py  whether this CPU runs ggml's extra CPU kernels (AMX, repacked weights): the
               verdict, its cache and the probe (whose child is ``engine/kernelprobe.py``)
rpc.py         llama.cpp's RPC backend: serving this host's devices, probing another's
               (in a child process)
ggmllib.py     the ggml library of llama-cpp-python, opened without importing llama_cpp
"""
