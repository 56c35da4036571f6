"""``quantize serve``: the engine behind an OpenAI-compatible HTTP API (app.py), the engine on its
own thread (async_engine.py), the request bodies (protocol.py) and ``/metrics`` (metrics.py)."""
