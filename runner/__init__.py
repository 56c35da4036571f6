"""Running models: the paged, continuously batched engine (``runner.engine``, with ``LLM`` and
``SamplingParams`` here as its front door) and the memory-fit calculator (``runner.fit``)."""

_EXPORTS = {"LLM": "runner.engine.llm", "RequestOutput": "runner.engine.llm", "SamplingParams": "runner.engine.sampling"}


def __getattr__(name: str):
    """Import the engine only when it is used: `quantize fit` needs none of it."""
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'runner' has no attribute {name!r}")
