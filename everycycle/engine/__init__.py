"""The engine: llama.cpp with a model loaded, its decode loop, and the process it runs
in. Imports the ground, chatfmt and hardware; knows nothing of sockets, clients or the
registry.

contract.py   the ``Engine`` Protocol the supervisor depends on, and the pipe's typed
              messages
process.py    the daemon's proxy for a model's engine process (``EngineProcess``)
child.py      the engine process itself: a Runner served over the pipe
              (``python -m everycycle.engine.child``)
runner.py     a loaded model and its any-thread API (``Runner``)
steps.py      the engine thread's decode loop: admit, build the batch, decode, sample
batchdecode.py a step's plan decoded: one llama_decode, stoppable, timed
slots.py      one decoding slot: its sequence in the KV cache, its job, the text it owes
sampling.py   llama.cpp's sampler chains for a job
constraint.py constrained decoding: llguidance's tokenizer for the vocabulary, a
              matcher per slot (the mask before the chain)
drafts.py     drafts in a step's batch (the tokens a grammar forces, prompt lookup's, a
              draft model's), verified as one-at-a-time decoding chooses; the policy
draftmodel.py a draft model beside the model: its vocabulary checked, greedy drafts
lookup.py     prompt-lookup drafts (no llama.cpp)
stepcost.py   what a step costs by rows and micro-batches, as measured (no llama.cpp)
probes.py     the load-time batch probe (exactness, step timings)
kernelprobe.py the CPU-kernel probe's child (``python -m everycycle.engine.kernelprobe``)
batchrow.py   a llama_batch's rows, written one at a time
pace.py       a slot's pace with the draft model (its drafts' rate, its rest)
jobs.py       Job in, Outputs out, stop strings and held-back text
vocab.py      a loaded model's vocabulary, and llama.cpp's own chat-template renderer
tokencache.py a long chat prompt tokenized by its pieces, each long one once
promptcache.py the conversations a model's slots gave up, in host RAM, spilled to disk
kvdisk.py     a model's cached prefixes (slots' KV state) on disk, checksummed
embedder.py   embeddings: a second context in embeddings mode, batched
vision.py     images in: the libmtmd projector, Pillow decoding
llamaload.py  a GGUF loaded onto an executor's devices, and its context
llamalog.py   llama.cpp's process-wide set-up: backends, and its log captured per thread
"""
