"""The OpenAI API's request bodies as the server accepts them, and its error shape.

Fields a client may send that change nothing here (``user``, ``metadata``) are ignored; fields
that would change the output in a way the engine cannot honour (``best_of``, ``suffix``) are
refused by name, not silently dropped.

A completion request may carry several prompts (a list of strings or of token-id lists) and ask
for ``n`` choices of each: choice ``i * n + j`` is prompt ``i``'s ``j``-th, as OpenAI numbers them.
``echo`` puts the prompt before the completion, and with ``logprobs`` scores every prompt token
after the first: what evaluation harnesses (lm-eval's ``local-completions``) ask to score a text.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator


class APIError(Exception):
    """An error the client gets in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


MAX_CHOICES = 128  # n, and prompts times n in one request


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """What completions and chat completions share (numbers finite: JSON's 1e999 is inf to Python)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: StrictStr
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: StrictInt = Field(-1, ge=-1)  # vLLM's extension
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)  # vLLM's extension
    ignore_eos: bool = False  # vLLM's extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_CHOICES)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0)  # vLLM's extension
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)  # token id (as JSON keys are strings) to bias

    @model_validator(mode="after")
    def _bias(self):
        for token, bias in (self.logit_bias or {}).items():
            if not token.isdigit() or not -100 <= bias <= 100:
                raise ValueError(f"logit_bias: {token!r}: {bias}: token ids to biases in [-100, 100]")
        return self

    def bias(self) -> dict[int, float]:
        return {int(t): b for t, b in (self.logit_bias or {}).items()}

    @model_validator(mode="after")
    def _stops(self):
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return self


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: Literal[1, None] = None
    suffix: None = None

    def prompts(self) -> list[str | list[int]]:
        """Every prompt of the request, in order: a text, a list of token ids, or a list of either."""
        p = self.prompt
        prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
        if not prompts:
            raise APIError(400, "prompt: an empty list of prompts", "prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(400, f"prompt: {len(prompts)} prompts of n {self.n} choices each; at most {MAX_CHOICES} "
                                "choices a request", "prompt")
        return prompts


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: a text (special tokens added by default) or a conversation (the chat
    template's text, with its own special tokens)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True  # for a prompt; a conversation's template writes its own
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages, one of them")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    tokens: list[StrictInt]


Body = Union[CompletionRequest, ChatCompletionRequest]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
