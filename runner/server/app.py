"""The OpenAI-compatible HTTP API on the engine: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (streamed as server-sent events or not), ``/health`` and ``/metrics``.

Every error a client can cause comes back in OpenAI's shape with its status (400 invalid, 401 key,
404 model or route, 413 body over the limit or prompt longer than the context, 429 queue full); a
client that disconnects has its request aborted at once, streaming or not.

A hostile request costs its sender, not everyone: its body is bounded and its JSON shape checked
before parsing (runner/server/guard.py), a text that cannot fit the context is refused before it
is tokenized (runner/server/token_bound.py), and a long text is tokenized on a worker thread, so
the event loop keeps answering the others. (Output text is detokenized on the engine's thread.)
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from core.errors import InputError
from runner.engine.sampling import SamplingParams
from runner.server.async_engine import AsyncEngine, Overloaded, Request, Update
from runner.server.guard import BodyGuard, Limits
from runner.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                    usage)
from runner.server.token_bound import max_token_bytes, min_tokens

# For a model whose tokenizer has no chat template (a base model): the conversation as plain text.
PLAIN_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n\n{% endfor %}"
                       "{% if add_generation_prompt %}Assistant:{% endif %}")
# Texts up to this many characters are tokenized on the event loop: tens of microseconds, less than
# a hop to a worker thread costs. Longer ones go to a thread (the tokenizer lets go of the GIL).
TOKENIZE_INLINE = 4096


@dataclass
class Choice:
    """One sequence of a client's request: choice ``index`` of the response, its prompt's ids, its
    sampling, and with ``echo`` the prompt's text to put before its completion."""

    index: int
    ids: list[int]
    params: SamplingParams
    echo: str | None = None


class Server:
    """What the routes share: the engine, the tokenizer, the model's name and the API key."""

    def __init__(self, engine: AsyncEngine, model_name: str, api_key: str | None, chat_template: str | None):
        self.engine, self.model_name, self.api_key = engine, model_name, api_key
        self.tokenizer = engine.llm.tokenizer
        self.own_template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.chat_template = self.own_template or PLAIN_CHAT_TEMPLATE
        self.max_model_len = engine.engine.max_model_len
        self.vocab = engine.engine.arch.vocab
        self.per_token = max_token_bytes(self.tokenizer)  # None: no sound bound for this tokenizer

    # -- requests to engine inputs ----------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"model {name!r} does not exist here; this server serves {self.model_name!r}", "model",
                           "model_not_found")

    async def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if len(prompt) >= self.max_model_len:  # before looking at each id
                self.refuse_length(len(prompt), "prompt")
            if any(not 0 <= t < self.vocab for t in prompt):
                raise APIError(400, f"prompt: a token id outside the vocabulary (0..{self.vocab - 1})", "prompt")
            ids = list(prompt)
        else:
            self.check_fits(prompt, "prompt")
            ids = await off_loop(len(prompt), self.tokenize, prompt, True, "prompt")
        if not ids:
            raise APIError(400, "prompt: empty", "prompt")
        return ids

    async def chat_ids(self, body: ChatCompletionRequest | TokenizeRequest, generation_prompt: bool = True,
                       fits: bool = True) -> list[int]:
        conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
        size = sum(len(m["content"]) for m in conversation)
        text = await off_loop(size, self.render, conversation, generation_prompt)
        if fits:
            self.check_fits(text, "messages")
        # A model's own template writes its special tokens itself; the plain one relies on the tokenizer's.
        return await off_loop(len(text), self.tokenize, text, self.own_template is None, "messages")

    def render(self, conversation: list[dict], generation_prompt: bool = True) -> str:
        try:
            return self.tokenizer.apply_chat_template(conversation, chat_template=self.chat_template, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # the template refuses the conversation (jinja's raise_exception)
            raise APIError(400, f"messages: the chat template refuses them: {error}", "messages") from None

    def tokenize(self, text: str, special: bool, param: str) -> list[int]:
        try:
            return self.tokenizer(text, add_special_tokens=special)["input_ids"]
        except Exception as error:  # text the tokenizer cannot take (a lone surrogate from a \ud800 escape)
            raise APIError(400, f"{param}: cannot be tokenized ({type(error).__name__}: {error})", param) from None

    def check_fits(self, text: str, param: str) -> None:
        """413 for a text that takes at least the context in tokens, known from its length alone."""
        least = min_tokens(text, self.per_token)
        if least >= self.max_model_len:
            raise APIError(413, f"{param}: at least {least:,} tokens (no token of this model stands for more than "
                                f"{self.per_token} bytes); this model's context is {self.max_model_len} tokens, prompt "
                                "and output together", param, "context_length_exceeded")

    def refuse_length(self, tokens: int, param: str) -> None:
        raise APIError(413, f"{param}: {tokens} tokens; this model's context is {self.max_model_len} tokens, "
                            "prompt and output together", param, "context_length_exceeded")

    def params(self, body, ids: list[int], max_tokens: int | None, logprobs: int | None, param: str,
               prompt_logprobs: int | None = None, choice: int = 0) -> SamplingParams:
        """A choice's sampling: the request's, with the ``choice``-th seed after the request's own
        (so that ``n`` seeded choices differ from one another and each repeats)."""
        if len(ids) >= self.max_model_len:
            self.refuse_length(len(ids), param)
        if any(t >= self.vocab for t in body.bias()):
            raise APIError(400, f"logit_bias: a token id outside the vocabulary (0..{self.vocab - 1})", "logit_bias")
        room = self.max_model_len - len(ids)
        max_tokens = room if max_tokens is None else max_tokens
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens}: the prompt's {len(ids)} tokens leave room for {room} in this "
                                f"model's context of {self.max_model_len}", "max_tokens", "context_length_exceeded")
        try:
            seed = None if body.seed is None else (body.seed + choice) % 2**63
            return SamplingParams(max_tokens=max_tokens, temperature=body.temperature, top_k=body.top_k,
                                  top_p=body.top_p, seed=seed, stop=body.stop, stop_token_ids=body.stop_token_ids,
                                  ignore_eos=body.ignore_eos, presence_penalty=body.presence_penalty,
                                  frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                                  logit_bias=body.bias(),
                                  logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except InputError as error:  # what the engine refuses that the schema let through
            raise APIError(400, str(error)) from None

    def submit(self, choices: list[Choice]) -> list[Request]:
        try:
            return self.engine.submit([(c.ids, c.params) for c in choices])
        except Overloaded as error:
            raise APIError(429, str(error), None, "rate_limit_exceeded") from None

    # -- engine outputs to responses --------------------------------------------------------------

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def completion_logprobs(self, update_list: list[Update], offset: int, echoed: list[int] | None = None) -> dict:
        """The legacy completions' log-probabilities of ``update_list``'s tokens, text offsets from
        ``offset``; with ``echoed`` (the prompt's ids, in the first update's response) the prompt's
        first: its first token unscored (null), the others as the engine scored them."""
        tokens, chosen, top = _scored(update_list)
        named = lambda ranked: {self.token_text(t): lp for t, lp in ranked.items()}  # noqa: E731
        tops = [named(d) for d in top] if top else None
        if echoed is not None:  # both scored with the same N, so both have tops or neither
            first = next((u for u in update_list if u.prompt_logprobs is not None), None)
            unscored = [None] * (len(echoed) - 1)  # a request ended before its prompt was scored
            tokens, chosen = echoed + tokens, [None, *(first.prompt_logprobs if first else unscored)] + chosen
            if tops is not None:
                prompt_tops = first.prompt_top_logprobs if first else None
                tops = [None, *([named(d) for d in prompt_tops] if prompt_tops is not None else unscored)] + tops
        texts = [self.token_text(t) for t in tokens]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {"tokens": texts, "token_logprobs": chosen, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, update_list: list[Update]) -> dict:
        tokens, chosen, top = _scored(update_list)
        top = top or [{}] * len(tokens)

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in d.items()]}
                            for t, lp, d in zip(tokens, chosen, top)]}


def _scored(update_list: list[Update]) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """The updates' tokens, their log-probabilities and their likeliest alternatives, in order."""
    return ([t for u in update_list for t in u.token_ids], [lp for u in update_list for lp in u.logprobs],
            [d for u in update_list for d in u.top_logprobs])


async def off_loop(size: int, work, *args):
    """``work(*args)``: on the event loop for a small ``size``, else on a worker thread."""
    if size <= TOKENIZE_INLINE:
        return work(*args)
    return await asyncio.to_thread(work, *args)


async def merged(requests: list[Request]) -> AsyncIterator[tuple[int, Update]]:
    """The updates of several requests as they come, each with its request's place in the list,
    until every one has had its last; the first engine error as an APIError."""
    if len(requests) == 1:
        async for update in updates(requests[0]):
            yield 0, update
        return
    pending = {asyncio.ensure_future(r.updates.get()): i for i, r in enumerate(requests)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.get):
                at = pending.pop(task)
                update = task.result()
                if update.error is not None:
                    raise APIError(*update.error)
                yield at, update
                if update.finish_reason is None:
                    pending[asyncio.ensure_future(requests[at].updates.get())] = at
    finally:
        for task in pending:
            task.cancel()


async def updates(request: Request) -> AsyncIterator[Update]:
    """A request's updates until its last; an engine error as an APIError."""
    while True:
        update = await request.updates.get()
        if update.error is not None:
            raise APIError(*update.error)
        yield update
        if update.finish_reason is not None:
            return


async def disconnected(http: HTTPRequest) -> None:
    """Returns once the client has gone (the body was read already, so nothing else arrives)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(engine: AsyncEngine, model_name: str, api_key: str | None = None, chat_template: str | None = None,
               max_request_bytes: int | None = None) -> FastAPI:
    """The app; ``max_request_bytes`` (default: from the context, guard.default_max_request_bytes)
    bounds a request's body."""
    server = Server(engine, model_name, api_key, chat_template)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.close)

    app = FastAPI(title="quantbench", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyGuard, limits=Limits.for_context(server.max_model_len, max_request_bytes))

    @app.exception_handler(APIError)
    async def api_error(_: HTTPRequest, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HTTPRequest, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            where, message = "", "the body is not valid JSON"
        elif first.get("type") in ("model_attributes_type", "dict_type") and not where:
            message = "the body must be a JSON object"
        return JSONResponse(APIError(400, f"{where}: {message}" if where else message, where or None).body(),
                            status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_: HTTPRequest, error: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def crash(_: HTTPRequest, error: Exception) -> JSONResponse:
        return JSONResponse(APIError(500, f"internal error: {type(error).__name__}: {error}").body(), status_code=500)

    def authorize(http: HTTPRequest) -> None:
        if api_key is not None:
            given = http.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "a missing or wrong API key (Authorization: Bearer KEY)", None, "invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse(APIError(503, "the engine thread has stopped").body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        e = engine.engine
        blocks = e.blocks
        rate = blocks.hit_tokens / blocks.queried_tokens if blocks.queried_tokens else 0.0
        text = engine.metrics.render([
            ("num_requests_running", "gauge", "Requests in the running batch.", len(e.scheduler.running)),
            ("num_requests_waiting", "gauge", "Requests queued or preempted.", len(e.scheduler.waiting)),
            ("kv_blocks_used", "gauge", "KV-cache blocks held by requests.", blocks.num_blocks - blocks.num_free),
            ("kv_blocks_free", "gauge", "KV-cache blocks free (cached prefixes among them).", blocks.num_free),
            ("prefix_cache_hit_rate", "gauge", "Share of admitted prompt tokens found in the prefix cache.", rate),
            ("prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", blocks.queried_tokens),
            ("prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", blocks.hit_tokens),
            ("preemptions_total", "counter", "Requests preempted for lack of KV blocks (recomputed later).", e.scheduler.preemptions),
            ("speculative_acceptance_rate", "gauge", "Share of speculative guesses the model accepted (0 without --speculative).",
             e.spec_accepted / e.spec_proposed if e.spec_proposed else 0.0),
            ("speculative_guesses_total", "counter", "Speculative guesses verified.", e.spec_proposed),
            ("speculative_accepted_total", "counter", "Speculative guesses accepted.", e.spec_accepted),
        ])
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    # vLLM's tokenizer routes, beside /v1: a client (lm-eval's remote tokenizer) tokenizes as the
    # server does without a copy of the tokenizer, which a GGUF-served model has nowhere else
    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        if body.messages is not None:
            ids = await server.chat_ids(body, body.add_generation_prompt, fits=False)
        else:
            ids = await off_loop(len(body.prompt), server.tokenize, body.prompt, body.add_special_tokens, "prompt")
        return {"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            server.check_model(body.model)
        if any(not 0 <= t < server.vocab for t in body.tokens):
            raise APIError(400, f"tokens: a token id outside the vocabulary (0..{server.vocab - 1})", "tokens")
        return {"prompt": await off_loop(len(body.tokens), server.tokenizer.decode, body.tokens)}

    @app.get("/tokenizer_info", dependencies=[Depends(authorize)])
    async def tokenizer_info() -> dict:
        t = server.tokenizer
        return {"tokenizer_class": type(t).__name__, "eos_token": t.eos_token, "bos_token": t.bos_token,
                "pad_token": t.pad_token, "unk_token": t.unk_token, "chat_template": server.own_template,
                "model_max_length": server.max_model_len}

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "quantbench", "max_model_len": server.max_model_len}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        server.check_model(body.model)
        choices = []
        for prompt in body.prompts():
            ids = await server.prompt_ids(prompt)
            echo = (prompt if isinstance(prompt, str) else server.tokenizer.decode(ids)) if body.echo else None
            scored = body.logprobs if body.echo else None
            choices += [Choice(len(choices) + j, ids, server.params(body, ids, body.max_tokens, body.logprobs, "prompt", scored, j),
                               echo) for j in range(body.n)]
        return await respond(http, body, choices, chat=False)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        server.check_model(body.model)
        ids = await server.chat_ids(body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = body.max_completion_tokens or body.max_tokens
        choices = [Choice(j, ids, server.params(body, ids, max_tokens, logprobs, "messages", None, j)) for j in range(body.n)]
        return await respond(http, body, choices, chat=True)

    async def respond(http: HTTPRequest, body, choices: list[Choice], chat: bool):
        requests = server.submit(choices)
        rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
        prompt_count = sum(len(c.ids) for c in choices[:: body.n])
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream(choices, requests, rid, created, chat, include_usage, prompt_count),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        got: list[list[Update]] = [[] for _ in choices]

        async def collect() -> None:
            async for index, update in merged(requests):
                got[index].append(update)

        work, gone = asyncio.ensure_future(collect()), asyncio.ensure_future(disconnected(http))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            # the client left (or the server is stopping), or one sequence failed: end them all now
            if not work.done() or work.exception() is not None:
                work.cancel()
                for request in requests:
                    engine.abort(request)
        if gone.done() and not work.done():
            return PlainTextResponse("", status_code=499)
        work.result()  # an engine error as its APIError
        out, tokens = [], 0
        for choice, updates_of in zip(choices, got):
            text = "".join(u.text for u in updates_of)
            tokens += sum(len(u.token_ids) for u in updates_of)
            want_logprobs = choice.params.logprobs is not None
            if chat:
                out.append({"index": choice.index, "message": {"role": "assistant", "content": text},
                            "logprobs": server.chat_logprobs(updates_of) if want_logprobs else None,
                            "finish_reason": updates_of[-1].finish_reason})
            else:
                echoed = choice.ids if choice.echo is not None else None
                out.append({"index": choice.index, "text": (choice.echo or "") + text,
                            "logprobs": server.completion_logprobs(updates_of, 0, echoed) if want_logprobs else None,
                            "finish_reason": updates_of[-1].finish_reason})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": out, "usage": usage(prompt_count, tokens)}

    async def stream(choices: list[Choice], requests: list[Request], rid: str, created: int, chat: bool,
                     include_usage: bool, prompt_tokens: int) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(parts: list[dict], **extra) -> str:
            payload = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": parts, **extra}
            if include_usage and "usage" not in extra:
                payload["usage"] = None
            return f"data: {json.dumps(payload)}\n\n"

        finished, tokens = [False] * len(choices), 0
        offsets, echoed = [0] * len(choices), [False] * len(choices)
        try:
            if chat:
                for choice in choices:
                    yield event([{"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            async for at, update in merged(requests):
                choice = choices[at]
                finished[at] = update.finish_reason is not None
                tokens += len(update.token_ids)
                first = choice.echo is not None and not echoed[at]
                echoed[at] = True
                text = (choice.echo if first else "") + update.text
                logprobs = None
                if choice.params.logprobs is not None and update.token_ids:
                    logprobs = (server.chat_logprobs([update]) if chat else
                                server.completion_logprobs([update], offsets[at], choice.ids if first else None))
                offsets[at] += len(text)
                if text or update.token_ids or finished[at]:
                    piece = {"content": text} if text or not finished[at] else {}
                    part = {"delta": piece} if chat else {"text": text}
                    yield event([{"index": choice.index, **part, "logprobs": logprobs, "finish_reason": update.finish_reason}])
            if include_usage:
                yield event([], usage=usage(prompt_tokens, tokens))
        except APIError as error:
            finished = [True] * len(choices)
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            for request, done in zip(requests, finished):
                if not done:  # the client left mid-stream: its requests end now, their blocks are freed
                    engine.abort(request)
        yield "data: [DONE]\n\n"

    app.include_router(v1)
    return app
