"""The engine: llama.cpp with a model loaded, its decode loop, and the process it runs
in. Imports the ground, chatfmt and hardware; knows nothing of sockets, clients or the
registry. One subpackage per part, each importing only those listed after it (the
imports go one way: tests/test_import_cycles.py):

host/     where an engine runs: the ``Engine`` contract the supervisor depends on and the
          pipe's messages, the daemon's proxy for an engine process, that process
worker/   the ``Runner`` and its engine thread: step loop (admit, plan, decode, apply),
          batch decoder, seating and parking, preemption, sampling, constraints, LoRA,
          logits, embeddings, reranking, images
spec/     speculative decoding: a proposer per method (forced tokens, prompt lookup,
          draft model), the ``Drafter`` that asks them, their counts
kvcache/  KV cells kept beyond a slot: the prompt cache (RAM, disk), the token cache
llama/    llama.cpp itself: loading, its log, the vocabulary, the load-time probes
core/     what a step decides, as plain data: jobs, slots, the scheduler and its plan,
          step costs, thinking budgets, grammar matchers (no llama.cpp: tested)

A step, top to bottom: ``worker/steps.py`` (admit → plan → decode → apply → prepare),
the plan from ``core/scheduler.py`` (final as returned), drafts from
``spec/drafter.py`` (a model's made after a step for the next), the decode in
``worker/batchdecode.py``.
"""
