"""`quantize serve` driven by the real `openai` client over HTTP on 127.0.0.1 (completions and chat,
streamed and not), and by raw HTTP for what a client library would never send: malformed bodies,
wrong keys, clients that leave mid-request. What the server says must equal what the engine
computes offline; after every test no block is held, and after the server stops no thread is left."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from conftest import TINY
from runner import LLM, SamplingParams

pytestmark = pytest.mark.check  # the fast tier, `make check` (docs/testing.md)

KEY = "test-key"
NAME = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server on a thread of this process, so the test can look at its engine."""

    def __init__(self, max_num_seqs: int = 4, max_waiting: int = 64, max_model_len: int = 256, **engine):
        import uvicorn

        from runner.server.app import create_app
        from runner.server.async_engine import AsyncEngine

        self.llm = LLM(TINY, dtype="fp32", kv_memory=32 * 2**20, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                       **{"block_size": 16, **engine})  # blocks shorter than the tests' prompts: prefix hits
        self.engine = AsyncEngine(self.llm, max_waiting)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.engine, NAME, KEY), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def client(self, api_key: str = KEY):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0)

    def idle(self, timeout: float = 10) -> bool:
        """Whether every request has ended and every block is free (waiting up to ``timeout``)."""
        deadline = time.time() + timeout
        blocks, scheduler = self.llm.engine.blocks, self.llm.engine.scheduler
        while not (blocks.num_free == blocks.num_blocks and not scheduler.running and not scheduler.waiting):
            if time.time() > deadline:
                return False
            time.sleep(0.02)
        return True

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server():
    before = set(threading.enumerate())
    running = Running()
    yield running
    running.stop()
    assert not running.thread.is_alive() and not running.engine.alive
    assert running.idle(0)
    time.sleep(0.1)
    assert {t for t in threading.enumerate() if t.is_alive()} - before == set()  # no thread left behind


@pytest.fixture(autouse=True)
def nothing_held_after(request):
    yield
    if "server" in request.fixturenames:
        assert request.getfixturevalue("server").idle(), "a request or a block was left held"


@pytest.fixture(scope="module")
def offline():
    """The same model run offline by the engine, for what the server must say."""
    return LLM(TINY, dtype="fp32", kv_memory=32 * 2**20, max_model_len=256)


PROMPT = "It was a bright cold day in April, and the clocks"


def plain_chat(messages: list[dict]) -> str:
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages) + "Assistant:"


def test_models_lists_the_served_model(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [NAME]


def test_a_completion_is_what_the_engine_computes(server, offline):
    reply = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0))[0]
    choice = reply.choices[0]
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert reply.object == "text_completion" and reply.id.startswith("cmpl-")


def test_a_streamed_completion_adds_up_to_the_same_text(server, offline):
    chunks = list(server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0))[0]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert len([c for c in chunks if c.choices]) > 3  # streamed, not sent whole at the end
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_applies_the_template_streamed_or_not(server, offline):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me of the sea."}]
    client = server.client()
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0)
    expected = offline.generate(plain_chat(messages), SamplingParams(max_tokens=30, temperature=0))[0]
    assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids) and reply.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=30, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_sampling_by_seed_stop_strings_and_logprobs(server, offline):
    client = server.client()
    sampled = [client.completions.create(model=NAME, prompt=PROMPT, max_tokens=20, temperature=1.0, top_p=0.9, seed=7).choices[0].text
               for _ in range(2)]
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7))[0].text
    assert sampled == [expected, expected]
    greedy = offline.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0))[0].text
    stop = greedy[10:14]
    cut = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    assert cut.choices[0].text == greedy[: greedy.index(stop)] and cut.choices[0].finish_reason == "stop"
    scored = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3)
    reference = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0, logprobs=3))[0]
    lp = scored.choices[0].logprobs
    assert "".join(lp.tokens) == scored.choices[0].text
    assert lp.token_logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(chosen, abs=1e-4)  # greedy: the likeliest
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)


def test_echo_scores_the_prompt_as_the_engine_does(server, offline):
    """What lm-eval's local-completions asks to score a text: echo, logprobs 1, one token more."""
    ids = offline.token_ids(PROMPT)
    reply = server.client().completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    reference = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1))[0]
    choice, lp = reply.choices[0], reply.choices[0].logprobs
    assert choice.text == offline.tokenizer.decode(ids) + reference.text
    assert len(lp.tokens) == len(ids) + 1 and lp.tokens[:-1] == [offline.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(reference.prompt_logprobs[1:] + reference.logprobs, abs=1e-5)
    tops = reference.prompt_top_logprobs[1:] + reference.top_logprobs
    assert [list(t.values()) for t in lp.top_logprobs[1:]] == [pytest.approx(list(t.values()), abs=1e-5) for t in tops]
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == 1
    text = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert text.choices[0].text.startswith(PROMPT) and text.choices[0].logprobs is None
    streamed = list(server.client().completions.create(model=NAME, prompt=ids, max_tokens=3, temperature=0, logprobs=0,
                                                       echo=True, stream=True))
    first = streamed[0].choices[0].logprobs
    assert streamed[0].choices[0].text.startswith(offline.tokenizer.decode(ids))
    assert first.token_logprobs[0] is None and first.token_logprobs[1:len(ids)] == pytest.approx(reference.prompt_logprobs[1:], abs=1e-5)


def test_penalties_are_the_engines(server, offline):
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 1.0, "repetition_penalty": 1.2}
    reply = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=30, temperature=0,
                                               presence_penalty=0.5, frequency_penalty=1.0,
                                               extra_body={"repetition_penalty": 1.2})
    expected = offline.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0, **penalties))[0]
    assert reply.choices[0].text == expected.text
    assert expected.text != offline.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0))[0].text
    token = offline.token_ids(" sea")[-1]
    forced = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=3, temperature=0,
                                                logit_bias={str(token): 100})
    assert forced.choices[0].text == offline.tokenizer.decode([token] * 3)


def test_several_prompts_and_n_choices_in_one_request(server, offline):
    prompts = [PROMPT, "The sea was", "Once upon a time"]
    client = server.client()
    reply = client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    expected = offline.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    assert [c.index for c in reply.choices] == [0, 1, 2] and [c.text for c in reply.choices] == [e.text for e in expected]
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    sampled = client.completions.create(model=NAME, prompt=prompts[:2], max_tokens=12, temperature=1.0, seed=5, n=3)
    assert [c.index for c in sampled.choices] == list(range(6))
    for i, prompt in enumerate(prompts[:2]):  # choice j of a prompt draws with seed 5 + j
        texts = [c.text for c in sampled.choices[3 * i : 3 * i + 3]]
        assert texts == [offline.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=5 + j))[0].text
                         for j in range(3)]
        assert len(set(texts)) == 3
    assert sampled.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected[:2])
    chunks = list(client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0, stream=True))
    for i, e in enumerate(expected):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == e.text
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0.8, seed=1, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.choices[0].message.content != chat.choices[1].message.content


def test_a_client_that_leaves_a_request_of_several_prompts_frees_every_block(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": NAME, "prompt": [PROMPT] * 3, "max_tokens": 200, "stream": True, "n": 2,
                            "ignore_eos": True}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                break
    assert server.idle()


def test_tokenize_detokenize_and_tokenizer_info_are_vllms(server, offline):
    ids = offline.token_ids(PROMPT)
    reply = post(server, "/tokenize", {"model": NAME, "prompt": PROMPT}).json()
    assert reply == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    bare = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()["tokens"]
    assert bare == offline.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()["tokens"]
    assert chat == offline.token_ids(plain_chat(messages))
    assert post(server, "/detokenize", {"tokens": bare}).json() == {"prompt": offline.tokenizer.decode(bare)}
    info = httpx.get(f"{server.url}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert info["eos_token"] == offline.tokenizer.eos_token and info["model_max_length"] == 256
    for path, body, fragment in [("/tokenize", {"model": NAME}, "one of them"), ("/detokenize", {"tokens": [99999]}, "vocabulary"),
                                 ("/tokenize", {"model": "gpt-5", "prompt": "x"}, "gpt-5")]:
        refused = post(server, path, body)
        assert refused.status_code in (400, 404) and fragment in refused.json()["error"]["message"]
    assert post(server, "/tokenize", {"prompt": "x"}, key=None).status_code == 401


def post(server, path: str, body, key: str | None = KEY, timeout: float = 30) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=timeout)


@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"model": NAME}, 400, "prompt"),
    ({"model": NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": NAME, "prompt": ["x"] * 20, "n": 8}, 400, "at most 128 choices"),
    ({"model": NAME, "prompt": []}, 400, "empty list"),
    ({"model": NAME, "prompt": "x", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": NAME, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"model": NAME, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ({"model": NAME, "prompt": [1, 99999]}, 400, "vocabulary"),
    ({"model": NAME, "prompt": [[1, 2], [1, 99999]]}, 400, "vocabulary"),
    ({"model": NAME, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": "gpt-5", "prompt": "x"}, 404, "gpt-5"),
    ({"model": NAME, "prompt": "word " * 400}, 413, "context"),
    ({"model": NAME, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens"),
    # hostile (issue 37): refused before parsing, before tokenizing, or before the engine sees them
    (b'{"model": "tiny", "prompt": "x", "temperature": 1e999}', 400, "finite"),
    (b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "levels deep"),
    ({"model": NAME, "prompt": [1] * 70_000}, 400, "values in its arrays"),
    (b'{"model": "tiny", "prompt": "\\ud800"}', 400, "cannot be tokenized"),
    ({"model": NAME, "prompt": "word " * 20_000}, 413, "at least"),
    ({"model": NAME, "prompt": "x" * 1_100_000}, 413, "request body is"),
])
def test_bad_requests_get_openai_shaped_errors(server, body, status, fragment):
    reply = post(server, "/v1/completions", body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"]
    assert "Traceback" not in reply.text


def test_a_body_over_the_limit_sent_in_chunks_is_cut_off(server):
    """No Content-Length to go by: the server reads up to its limit, then answers 413."""
    chunks = (b'{"model": "tiny", "prompt": "', *[b"word " * 200_000] * 10, b'"}')
    reply = httpx.post(f"{server.url}/v1/completions", content=iter(chunks), timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert reply.status_code == 413 and reply.json()["error"]["code"] == "request_too_large"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_freezing_temperature_is_greedy_not_a_failed_step(server, offline):
    """1e-40 would overflow the logits to inf and fail the step of every request in the batch."""
    reply = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=8, temperature=1e-40)
    assert reply.choices[0].text == offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].text


def test_chat_errors_name_the_field(server):
    reply = post(server, "/v1/chat/completions", {"model": NAME, "messages": [{"role": "wizard", "content": "x"}]})
    assert reply.status_code == 400 and "messages" in reply.json()["error"]["param"]
    reply = post(server, "/v1/chat/completions", {"model": NAME, "messages": []})
    assert reply.status_code == 400


def test_a_wrong_or_missing_key_gets_401_and_health_and_metrics_stay_open(server):
    import openai

    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="nope").models.list()
    for key in (None, "nope"):
        reply = post(server, "/v1/completions", {"model": NAME, "prompt": "x"}, key=key)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/nowhere").json()["error"]["type"] == "not_found_error"


def test_a_client_that_leaves_mid_stream_frees_its_blocks_at_once(server):
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=30) as reply:
        lines = reply.iter_lines()
        seen = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert seen and server.llm.engine.scheduler.running  # it is being generated
    assert server.idle(5)


def aborted(server) -> int:
    """Requests the server has ended because their client left."""
    text = httpx.get(f"{server.url}/metrics").text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("quantbench_requests_finished_total") and 'finish_reason="abort"' in line)


@pytest.mark.parametrize("prompt, n", [(PROMPT, 1), ([PROMPT, "The sea"], 2)])
def test_a_client_that_leaves_before_a_whole_reply_frees_its_blocks(server, prompt, n):
    before = aborted(server)
    body = {"model": NAME, "prompt": prompt, "n": n, "max_tokens": 230, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", body, timeout=0.3)
    assert server.idle(5)
    assert aborted(server) - before == (1 if isinstance(prompt, str) else len(prompt)) * n  # ended, not run to the end


def test_metrics_count_what_was_served(server):
    server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["quantbench_time_to_first_token_seconds_count"]) >= 1
    assert float(samples['quantbench_time_to_first_token_seconds_bucket{le="+Inf"}']) == \
        float(samples["quantbench_time_to_first_token_seconds_count"])
    assert float(samples["quantbench_kv_blocks_used"]) == 0
    assert float(samples["quantbench_kv_blocks_free"]) == server.llm.engine.blocks.num_blocks
    assert float(samples["quantbench_prefix_cache_hit_tokens_total"]) > 0  # PROMPT was sent before
    for name in ("num_requests_running", "num_requests_waiting", "preemptions_total", "prefix_cache_hit_rate",
                 "speculative_acceptance_rate"):
        assert f"quantbench_{name}" in samples


def test_a_full_queue_gets_429_and_every_other_request_completes():
    """More clients at once than the server runs and queues: the rest are refused, none hangs."""
    import asyncio

    running = Running(max_num_seqs=2, max_waiting=3)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}

    async def one(client: httpx.AsyncClient) -> str:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                await reply.aread()
                return str(reply.status_code) if reply.json()["error"]["code"] == "rate_limit_exceeded" else reply.text
            lines = [line async for line in reply.aiter_lines() if line.startswith("data: ")]
            return "done" if lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2] else "broken"

    async def crowd() -> list[str]:
        async with httpx.AsyncClient(base_url=running.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as client:
            return await asyncio.gather(*(one(client) for _ in range(16)))

    try:
        outcomes = asyncio.run(crowd())
        assert set(outcomes) == {"done", "429"} and outcomes.count("done") >= 5, outcomes
        assert running.idle(5)
        assert httpx.get(f"{running.url}/health").status_code == 200
    finally:
        running.stop()


def test_quantize_serve_starts_answers_and_stops_on_ctrl_c(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    port = free_port()
    quantize = [sys.executable, "-c", "from recipes.cli import main; main()"]
    proc = subprocess.Popen([*quantize, "serve", str(TINY), "--port", str(port), "--max-num-seqs", "2", "--kv-memory", "16MiB",
                             "--served-model-name", "mine"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model="mine", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
        busy = subprocess.run([*quantize, "serve", str(TINY), "--port", str(port)], capture_output=True, text=True)
        assert busy.returncode == 2 and busy.stderr.count("\n") == 1 and f"--port {port}" in busy.stderr, busy.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and f"serving mine on http://127.0.0.1:{port}/v1" in err


@pytest.mark.parametrize("args, fragment", [
    (["serve", "/no/such/model"], "/no/such/model"),
    (["serve", str(TINY), "--port", "0"], "--port 0"),
    (["serve", str(TINY), "--max-waiting", "0"], "--max-waiting 0"),
    (["serve", str(TINY), "--max-request-bytes", "10"], "--max-request-bytes 10"),
    (["serve", str(TINY), "--chat-template", "/no/such.jinja", "--port", "1"], "/no/such.jinja"),
])
def test_quantize_serve_refuses_bad_options_in_one_line(monkeypatch, capsys, args, fragment):
    from helpers.cli import assert_user_error, quantize

    assert_user_error(quantize(monkeypatch, capsys, *args), fragment)

