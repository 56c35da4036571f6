"""Paged KV cache, scheduler, inference engine and memory-fit calculator (planned: issue 5 and later)."""
