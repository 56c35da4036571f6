"""Memory-fit: will a model fit a GPU, for how many users, how fast (``quantize fit``), and how much
memory quantizing it takes. The engine sizes its KV block pool from the same numbers."""
