"""An Ollama ``Modelfile`` beside each GGUF file, so ``ollama create NAME -f Modelfile`` just works.

Ollama's TEMPLATE is a Go template, not the Jinja chat template that Hugging Face models carry, so
it is written only for the chat formats recognised here (ChatML, Llama 3); other models get the
file and their stop tokens, and Ollama falls back to the template embedded in the GGUF.
"""

from __future__ import annotations

import json
from pathlib import Path

from formats.hf import HFCheckpoint

_CHATML = (
    '{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n'
)
_LLAMA3 = (
    '<|begin_of_text|>{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n'
    '{{ .Content }}<|eot_id|>{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n'
)


def modelfile_name(gguf_name: str) -> str:
    """``model.gguf`` -> ``model.Modelfile``."""
    return Path(gguf_name).stem + ".Modelfile"


def write_modelfile(path: Path, gguf_name: str, ckpt: HFCheckpoint) -> None:
    """Write, at ``path``, the Modelfile of the GGUF file ``gguf_name`` that lies beside it."""
    template, stops = _chat_format(ckpt)
    lines = [f"FROM ./{gguf_name}"]
    if template:
        lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER stop {json.dumps(s)}" for s in stops]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _chat_format(ckpt: HFCheckpoint) -> tuple[str | None, list[str]]:
    cfg = ckpt.tokenizer_config
    chat = cfg.get("chat_template") or ""
    if not chat and (ckpt.path / "chat_template.jinja").is_file():
        chat = (ckpt.path / "chat_template.jinja").read_text()
    eos = cfg.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if "<|im_start|>" in chat:
        return _CHATML, ["<|im_end|>", "<|im_start|>"]
    if "<|start_header_id|>" in chat:
        return _LLAMA3, ["<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    return None, [eos] if eos else []
