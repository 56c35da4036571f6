"""The paged, continuously batched engine: sequences, the KV block pool, the scheduler, the model
runner and the sampler, each in its own module; ``runner.LLM`` is its front door."""
