"""Start the server: check the address, build the app, run uvicorn until interrupted."""

from __future__ import annotations

import socket
from pathlib import Path

from core.errors import InputError
from runner.engine.llm import LLM
from runner.server.app import create_app
from runner.server.async_engine import AsyncEngine


def check_options(host: str, port: int, max_waiting: int, max_request_bytes: int | None = None) -> None:
    """One clear line for an address that cannot be served, before the model loads."""
    if max_request_bytes is not None and max_request_bytes < 1024:
        raise InputError(f"--max-request-bytes {max_request_bytes}: must be 1024 or more")
    if max_waiting < 1:
        raise InputError(f"--max-waiting {max_waiting}: must be 1 or more")
    if not 0 < port < 65536:
        raise InputError(f"--port {port}: must be in 1..65535")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as error:
        raise InputError(f"--host {host} --port {port}: cannot listen there ({error.strerror or error})") from None


def serve(llm: LLM, host: str, port: int, model_name: str, api_key: str | None, max_waiting: int,
          chat_template: Path | None, announce, max_request_bytes: int | None = None) -> None:
    import uvicorn

    template = None
    if chat_template is not None:
        try:
            template = chat_template.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise InputError(f"--chat-template {chat_template}: cannot read it ({error})") from None
    app = create_app(AsyncEngine(llm, max_waiting), model_name, api_key, template, max_request_bytes)
    announce(f"serving {model_name} on http://{host}:{port}/v1 (OpenAI API; Ctrl-C stops)")
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
