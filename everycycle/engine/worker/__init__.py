"""The engine thread and what it drives: the ``Runner`` (a model loaded, its any-thread
API), the step loop (admit, plan, decode, apply), the batch decoder, seating and
parking jobs on slots, preemption, sampler chains and constraints, LoRA, logits,
embeddings, reranking, images."""
