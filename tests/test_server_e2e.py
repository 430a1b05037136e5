"""End-to-end: `python -m minisgl serve` as real processes, driven by the official openai client.

Two servers per module (each started once): `server` with default flags, and
`server_dyn` with --enable-dynamic-batch-tokenizer, --api-key, --chat-template and compact JSON for
structured output. The oracle for text is
the in-process Engine on the same tiny model, greedy. The last test kills server_dyn's
scheduler and expects the server to exit non-zero within seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

from minisgl.test_utils import CHAT_TEMPLATE

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 8
PROMPTS = ["The quick brown fox", "def main():", "Python lists are", "In the beginning"]


# The tiny model's chat template, plus an assistant's tool calls (the Responses and Messages e2e tests
# send tool results back, and check what the template renders of the calls before them)
TOOL_CALLS_TEMPLATE = CHAT_TEMPLATE.replace(
    "+ '<|im_end|>\n' }}",
    "}}{% for c in m['tool_calls'] or [] %}{{ '<call>' + c['function']['name'] + (c['function']['arguments'] | tojson) + '</call>' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}",
)


class Server:
    """A `minisgl serve` child on a free port (the e2e tests' server): its log, its ready URL, the
    pids its processes print (`minisgl NAME pid=N`). `flags` come last, so they override the
    defaults here (argparse keeps the last value)."""

    def __init__(self, model: str, log_path: str, *flags: str, timeout: float = 180) -> None:
        env = dict(os.environ, MINISGL_REQUEST_STATE_WAIT_TIMEOUT="0.5", HF_HUB_OFFLINE="1")
        cmd = [sys.executable, "-m", "minisgl", "serve", "--model", model, "--port", "0", "--device", "cpu",
               "--max-total-tokens", "8192", "--log-level", "warning", *flags]  # fmt: skip
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.model = model
        self.url = self._wait_ready(timeout)
        self.pids = {name: int(pid) for name, pid in re.findall(r"minisgl (\w+) pid=(\d+)", self.read_log())}

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not (m := re.search(r"ready at (http://[\d.]+:\d+)", self.read_log())):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()  # (a server that never got ready is not left running)
                raise RuntimeError(f"server not ready (exit code {self.proc.returncode}):\n{self.read_log()}")
            time.sleep(0.2)
        return m.group(1)

    def stop(self) -> int:
        """SIGTERM (SIGKILL after 15 s); the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tiny_model, str(tmp_path_factory.mktemp("srv") / "server.log"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def server_dyn(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("srv")
    # --chat-template: the tiny model's own template, plus a line only `house_style` turns on
    template = folder / "house.jinja"
    template.write_text("{% if house_style %}{{ 'Answer briefly.' }}{% endif %}" + CHAT_TEMPLATE)
    s = Server(tiny_model, str(folder / "server_dyn.log"), "--enable-dynamic-batch-tokenizer", "--api-key", "sekret",
               "--visualize", "--constrained-json-disable-any-whitespace", "--chat-template", str(template))  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", max_total_tokens=8192)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def reference(engine: Any) -> Dict[str, Any]:
    """Greedy Engine outputs for the raw prompts and their chat renderings."""
    ref: Dict[str, Any] = {}
    for p in PROMPTS:
        chat_prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for key, text in (("raw", p), ("chat", chat_prompt)):
            out = engine.generate(text, {"max_new_tokens": MAX_TOKENS, "temperature": 0})
            ref[(key, p)] = out
    return ref


def _client(s: Server, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)


def _aclient(s: Server, **kw: Any) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=s.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0, timeout=120, **kw)


def _chat_msgs(p: str) -> List[Dict[str, str]]:
    return [{"role": "user", "content": p}]


# --------------------------------------------------------------------------- text equals the Engine
def test_chat_non_stream_matches_engine_and_counts_usage(server: Server, reference: Dict[str, Any]) -> None:
    client = _client(server)
    for p in PROMPTS[:2]:
        r = client.chat.completions.create(model=server.model, messages=_chat_msgs(p), max_tokens=MAX_TOKENS, temperature=0)
        ref = reference[("chat", p)]
        assert r.choices[0].message.content == ref["text"]
        assert r.choices[0].message.role == "assistant"
        assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.usage.prompt_tokens_details.cached_tokens >= 0
        assert r.choices[0].finish_reason in ("stop", "length")


def test_chat_stream_async_matches_engine_with_usage_chunk(server: Server, reference: Dict[str, Any]) -> None:
    async def run() -> None:
        client = _aclient(server)
        p = PROMPTS[2]
        stream = await client.chat.completions.create(
            model=server.model, messages=_chat_msgs(p), max_tokens=MAX_TOKENS, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        ref = reference[("chat", p)]
        assert text == ref["text"]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == [ref["meta_info"]["finish_reason"]["type"]]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref["meta_info"]["completion_tokens"]
        assert chunks[-1].usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
        await client.close()

    asyncio.run(run())


def test_completions_stream_and_not_match_engine(server: Server, reference: Dict[str, Any]) -> None:
    client = _client(server)
    p = PROMPTS[0]
    ref = reference[("raw", p)]
    r = client.completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.usage.completion_tokens == ref["meta_info"]["completion_tokens"]
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True) if c.choices)  # fmt: skip
    assert text == ref["text"]
    echo = client.completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert echo.choices[0].text == p + ref["text"]
    # "default" names whatever the server serves
    r = client.completions.create(model="default", prompt=p, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref["text"]


def test_stream_wire_format_is_sse(server: Server, reference: Dict[str, Any]) -> None:
    """What any SSE client relies on: the media type, no caching, `data:` events split by blank lines, [DONE] last."""
    p = PROMPTS[0]
    body = {"model": server.model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        raw = r.read().decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == reference[("raw", p)]["text"]


def test_completions_batch_and_token_id_prompts(server: Server, reference: Dict[str, Any], engine: Any) -> None:
    client = _client(server)
    r = client.completions.create(model=server.model, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [reference[("raw", p)]["text"] for p in PROMPTS[:3]]
    ids = engine.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == reference[("raw", PROMPTS[1])]["text"]
    assert r.usage.prompt_tokens == len(ids)


def test_default_completion_length_is_16(server: Server) -> None:
    r = _client(server).completions.create(model=server.model, prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_text(server: Server, engine: Any) -> None:
    p = PROMPTS[3]
    full = engine.generate(p, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})["text"]
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.find(stop)]
    r = _client(server).completions.create(model=server.model, prompt=p, max_tokens=24, temperature=0, stop=[stop],
                                           extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"


def test_stop_regex_cuts_the_text_streamed_or_not(server: Server, engine: Any) -> None:
    """SGLang's stop_regex: the text ends where the first match begins; matched_stop is the pattern."""
    p = PROMPTS[2]
    full = engine.generate(p, {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})["text"]
    piece = full[len(full) // 2 : len(full) // 2 + 2]
    pattern = re.escape(piece[0]) + "."  # (may first match before the piece: the search decides)
    expected = full[: re.search(pattern, full).start()]
    client = _client(server)
    kwargs: Dict[str, Any] = dict(model=server.model, prompt=p, max_tokens=24, temperature=0)
    body = {"ignore_eos": True, "stop_regex": [pattern, "never (matches)"]}
    r = client.completions.create(**kwargs, extra_body=body)
    assert r.choices[0].text == expected
    assert (r.choices[0].finish_reason, r.choices[0].matched_stop) == ("stop", pattern)
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    with pytest.raises(openai.BadRequestError, match=r"stop_regex '\(' is not a valid Python regular expression"):
        client.completions.create(**kwargs, extra_body={"stop_regex": "("})


def test_n2_returns_two_choices(server: Server, reference: Dict[str, Any]) -> None:
    p = PROMPTS[0]
    r = _client(server).chat.completions.create(model=server.model, messages=_chat_msgs(p), max_tokens=MAX_TOKENS, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content == reference[("chat", p)]["text"] for c in r.choices)
    ref_meta = reference[("chat", p)]["meta_info"]
    assert r.usage.prompt_tokens == ref_meta["prompt_tokens"]  # the prompt is counted once
    assert r.usage.completion_tokens == 2 * ref_meta["completion_tokens"]


def test_seed_reproducibility(server: Server) -> None:
    client = _client(server)

    def sample(seed: int) -> List[str]:
        r = client.completions.create(model=server.model, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, seed=seed, n=2,
                                      extra_body={"ignore_eos": True})  # fmt: skip
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(1234)
    assert sample(1234) == first
    assert len(first) == 2 and first[0] != first[1]  # sample j uses seed + j: the n choices differ
    assert sample(4321) != first


def test_logit_bias_bans_and_forces_tokens(server: Server, engine: Any) -> None:
    """OpenAI's logit_bias: -100 bans a token (greedy picks the next best), 100 forces one."""
    client = _client(server)
    ids = engine.tokenizer.encode(PROMPTS[0])
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    plain = engine.generate(input_ids=ids, sampling_params=greedy)["output_ids"]
    banned = {str(t): -100 for t in plain}
    steered = engine.generate(input_ids=ids, sampling_params={**greedy, "logit_bias": banned})
    assert len(steered["output_ids"]) == 6 and not set(steered["output_ids"]) & set(plain)
    r = client.completions.create(model=server.model, prompt=ids, max_tokens=6, temperature=0, logit_bias=banned,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert r.choices[0].text == steered["text"]
    forced = engine.tokenizer.encode(" the", add_special_tokens=False)[-1]
    chat = client.chat.completions.create(model=server.model, messages=_chat_msgs("hi"), max_tokens=4, temperature=1.0,
                                          logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})  # fmt: skip
    assert chat.choices[0].message.content == engine.tokenizer.decode([forced] * 4)


def test_regex_and_json_schema_constrain_the_openai_routes(server: Server) -> None:
    """The tiny model's random weights write noise: only the grammar makes these texts match."""
    client = _client(server)
    phone = r"[0-9]{3}-[a-z]{2,5}"
    r = client.chat.completions.create(model=server.model, messages=_chat_msgs("Call me"), max_tokens=32,
                                       extra_body={"regex": phone})  # fmt: skip
    assert re.fullmatch(phone, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    colours = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"enum": ["red", "green"]}}}
    stream = client.completions.create(model=server.model, prompt="A colour:", max_tokens=32, stream=True,
                                       extra_body={"response_format": colours})  # fmt: skip
    assert json.loads("".join(c.choices[0].text for c in stream)) in ("red", "green")


def test_logprobs_shape(server: Server) -> None:
    client = _client(server)
    r = client.chat.completions.create(model=server.model, messages=_chat_msgs(PROMPTS[0]), max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True, top_logprobs=3)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.logprob == pytest.approx(max(t.logprob for t in tok.top_logprobs), abs=1e-5)  # greedy picks the top
    if "\ufffd" not in r.choices[0].message.content:  # (a character split across tokens has no text of its own)
        assert "".join(t.token for t in content) == r.choices[0].message.content
    c = client.completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == c.usage.completion_tokens
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)  # logprobs=2 (fewer only when two tokens print alike)
    for t, token_logprob in zip(lp.top_logprobs, lp.token_logprobs):
        assert max(t.values()) == pytest.approx(token_logprob, abs=1e-5)  # greedy picks the top
    assert "".join(lp.tokens) == c.choices[0].text
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:k]) + lp.text_offset[0] for k in range(len(lp.tokens))]


def test_completions_echo_logprobs_score_the_prompt_as_the_engine_does(server: Server, engine: Any) -> None:
    """echo + logprobs with max_tokens 0: each prompt token's logprob, the first null, equal to
    the Engine's prompt logprobs on the same model."""
    c = _client(server).completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=0, echo=True, logprobs=1)
    lp = c.choices[0].logprobs
    assert c.choices[0].text == PROMPTS[0] and c.usage.completion_tokens == 0
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == c.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = engine.generate(PROMPTS[0], {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)["meta_info"]
    assert lp.token_logprobs[1:] == pytest.approx([v for v, _, _ in ref["input_token_logprobs"][1:]], abs=1e-4)
    for top, logprob in zip(lp.top_logprobs[1:], lp.token_logprobs[1:]):
        assert len(top) == 1 and max(top.values()) >= logprob - 1e-5  # the best alternative, at least as likely
    assert "".join(lp.tokens) == PROMPTS[0]


def test_completions_echo_logprobs_as_lm_eval_harness_reads_them(server: Server) -> None:
    """lm-eval-harness 0.4's loglikelihood request (local-completions): max_tokens 1, echo,
    logprobs 1, temperature 0; it sums token_logprobs[ctxlen:-1], so the prompt's entries come
    first and exactly one generated entry after them. Text offsets rise across prompt and answer
    even where a character is split over byte tokens."""
    prompt = "Emoji \U0001F642 then the end."
    c = _client(server).completions.create(model=server.model, prompt=prompt, max_tokens=1, echo=True, logprobs=1,
                                           temperature=0, seed=1234)  # fmt: skip
    lp = c.choices[0].logprobs
    assert len(lp.token_logprobs) == c.usage.prompt_tokens + 1 and lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[-1] == len(prompt) and c.choices[0].text.startswith(prompt)  # the answer starts after the echo
    assert lp.text_offset[lp.tokens.index(" the")] == prompt.index(" the")  # after the emoji's 4 byte tokens


def test_models_endpoint(server: Server) -> None:
    assert [m.id for m in _client(server).models.list().data] == [server.model]


def test_native_generate(server: Server, reference: Dict[str, Any]) -> None:
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}}
    out = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert out["text"] == reference[("raw", PROMPTS[0])]["text"]
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])
    body["text"] = PROMPTS[:2]
    outs = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert [o["text"] for o in outs] == [reference[("raw", p)]["text"] for p in PROMPTS[:2]]
    # SGLang's per-prompt lists: one sampling_params dict and one return_logprob per prompt
    body = {**body, "sampling_params": [body["sampling_params"], {"max_new_tokens": 2, "temperature": 0}],
            "return_logprob": [False, True]}  # fmt: skip
    outs = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    assert outs[0]["text"] == reference[("raw", PROMPTS[0])]["text"] and len(outs[1]["output_ids"]) == 2
    assert outs[0]["meta_info"]["output_token_logprobs"] == [] and len(outs[1]["meta_info"]["output_token_logprobs"]) == 2
    # streamed: SGLang's native stream carries the text so far in every event, then [DONE]
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    texts = [json.loads(e)["text"] for e in events[:-1]]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert texts[-1] == reference[("raw", PROMPTS[0])]["text"]


def test_native_generate_stream_is_cumulative_in_every_field(server: Server) -> None:
    """Each event holds everything so far (SGLang's shape): ids and logprobs grow together."""
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 1}  # fmt: skip
    whole = httpx.post(server.url + "/generate", json=body, timeout=60).json()
    prompt_len = whole["meta_info"]["prompt_tokens"]
    assert len(whole["meta_info"]["input_token_logprobs"]) == len(whole["meta_info"]["input_top_logprobs"]) == prompt_len - 1
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(events) > 1
    for e in events:
        n = len(e["output_ids"])
        assert len(e["meta_info"]["output_token_logprobs"]) == len(e["meta_info"]["output_top_logprobs"]) == n
        assert len(e["meta_info"]["input_token_logprobs"]) == prompt_len - 1  # from the first event on
    # The streamed request finds the first one's prompt in the radix cache (all but the positions its prompt
    # logprobs need), so its prefill multiplies fewer rows: float32 sums in another order, last-bit differences.
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert _logprob_entries_close(events[-1]["meta_info"][key], whole["meta_info"][key]), key


def _logprob_entries_close(got: Any, want: Any, tol: float = 1e-4) -> bool:
    """Nested (logprob, id, text) entries: the same shape, ids and texts equal, logprobs within tol."""
    if isinstance(got, list) and isinstance(want, list):
        return len(got) == len(want) and all(_logprob_entries_close(g, w, tol) for g, w in zip(got, want))
    if isinstance(got, float) and isinstance(want, float):
        return abs(got - want) <= tol
    return got == want


def test_native_generate_return_text_in_logprobs_names_each_token(server: Server, engine: Any) -> None:
    """SGLang's (logprob, id, text) entries: the text only with return_text_in_logprobs."""
    body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "top_logprobs_num": 2, "logprob_start_len": 0}  # fmt: skip
    plain = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    named = httpx.post(server.url + "/generate", json={**body, "return_text_in_logprobs": True}, timeout=60).json()["meta_info"]

    def entries(meta: Dict[str, Any]) -> List[Any]:
        tops = [e for key in ("output_top_logprobs", "input_top_logprobs") for top in meta[key] if top for e in top]
        return meta["output_token_logprobs"] + meta["input_token_logprobs"] + tops

    assert len(entries(named)) == len(entries(plain)) > 0
    assert all(text is None for _, _, text in entries(plain))
    assert all(text == engine.tokenizer.decode([t]) for _, t, text in entries(named))
    r = httpx.post(server.url + "/generate", json={"text": "hi", "return_text_in_logprobs": True}, timeout=60)
    assert r.status_code == 400 and "return_text_in_logprobs needs return_logprob" in r.json()["error"]["message"]


def test_native_generate_token_ids_logprob_scores_the_named_ids(server: Server, engine: Any) -> None:
    """SGLang's token_ids_logprob over HTTP: the named ids at every output token and scored prompt
    position, equal to the Engine's; streamed cumulatively; a list past the bound is a 400."""
    body = {"text": PROMPTS[1], "sampling_params": {"max_new_tokens": 3, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0, "token_ids_logprob": [5, 6]}  # fmt: skip
    meta = httpx.post(server.url + "/generate", json=body, timeout=60).json()["meta_info"]
    ref = engine.generate(PROMPTS[1], body["sampling_params"], return_logprob=True, logprob_start_len=0, token_ids_logprob=[5, 6])
    assert meta["input_token_ids_logprobs"][0] is None  # nothing scores the prompt's first token
    for key in ("output_token_ids_logprobs", "input_token_ids_logprobs"):
        ours, theirs = meta[key], ref["meta_info"][key]
        assert len(ours) == len(theirs) > 0
        for a, b in zip(ours, theirs):
            assert (a is None) == (b is None) and (a is None or [e[1] for e in a] == [5, 6])
            assert a is None or [e[0] for e in a] == pytest.approx([e[0] for e in b], abs=1e-4)
    with httpx.stream("POST", server.url + "/generate", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [len(e["meta_info"]["output_token_ids_logprobs"]) for e in events] == [len(e["output_ids"]) for e in events]
    r = httpx.post(server.url + "/generate", json={**body, "token_ids_logprob": list(range(257))}, timeout=60)
    assert r.status_code == 400 and "token_ids_logprob takes at most 256 ids" in r.json()["error"]["message"]
    # a batch: one list per prompt (None for a prompt that names none), and a start per prompt
    batch = {**body, "text": [PROMPTS[1], PROMPTS[0]], "token_ids_logprob": [[5, 6], None], "logprob_start_len": [0, -1]}
    outs = httpx.post(server.url + "/generate", json=batch, timeout=60).json()
    batched = outs[0]["meta_info"]["output_token_ids_logprobs"]  # (batched: equal up to float rounding)
    assert [[e[1] for e in pos] for pos in batched] == [[e[1] for e in pos] for pos in meta["output_token_ids_logprobs"]]
    assert [e[0] for pos in batched for e in pos] == pytest.approx([e[0] for pos in meta["output_token_ids_logprobs"] for e in pos], abs=1e-4)
    assert outs[1]["meta_info"]["output_token_ids_logprobs"] == outs[1]["meta_info"]["input_token_logprobs"] == []


def test_v1_score_matches_the_engine_and_reuses_a_scored_query(server: Server, engine: Any) -> None:
    """SGLang's /v1/score over a real server: the Engine's scores, SGLang's response shape, and a
    query scored again found in the radix cache (every prompt but its last token)."""
    body = {"query": "Zebras eat grass. Question: is it true? Answer:", "items": [" yes", " no", " maybe so"],
            "label_token_ids": [5, 17, 300], "apply_softmax": True}  # fmt: skip
    first = httpx.post(server.url + "/v1/score", json=body, timeout=60).json()
    assert set(first) == {"scores", "model", "usage", "object"} and first["object"] == "scoring" and first["model"] == "default"
    ref = engine.score(body["query"], body["items"], body["label_token_ids"], apply_softmax=True)
    for ours, theirs in zip(first["scores"], ref):
        assert ours == pytest.approx(theirs, abs=1e-4)
    usage = first["usage"]
    assert usage["completion_tokens"] == 0 and usage["total_tokens"] == usage["prompt_tokens"]
    again = httpx.post(server.url + "/v1/score", json=body, timeout=60).json()["usage"]
    assert again["prompt_tokens"] == usage["prompt_tokens"]
    assert again["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - len(body["items"])
    r = httpx.post(server.url + "/v1/score", json={**body, "label_token_ids": [10**6]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "label_token_ids"
    # item_first: the prompts are item + query, the Engine's item_first scores (not query + item's)
    flipped = httpx.post(server.url + "/v1/score", json={**body, "item_first": True}, timeout=60).json()["scores"]
    ref = engine.score(body["query"], body["items"], body["label_token_ids"], apply_softmax=True, item_first=True)
    for ours, theirs in zip(flipped, ref):
        assert ours == pytest.approx(theirs, abs=1e-4)
    assert flipped[0] != pytest.approx(first["scores"][0], abs=1e-4)


def test_v1_score_aborted_is_400_not_computed_and_frees_everything(server: Server) -> None:
    """/abort_request while a many-item /v1/score runs: the call answers the documented 400 (an item
    whose score was not computed), and the server is healthy and idle afterwards."""
    import threading

    # item_first and distinct items: no item shares a prefix, so the call keeps the scheduler busy
    items = [f" item number {i} of the list" for i in range(2000)]
    body = {"query": " Zebras eat grass. Question: is it true? Answer:" * 4, "items": items, "label_token_ids": [5, 17], "item_first": True}
    answer: Dict[str, Any] = {}
    thread = threading.Thread(target=lambda: answer.update(r=httpx.post(server.url + "/v1/score", json=body, timeout=120)))
    thread.start()
    deadline = time.monotonic() + 30
    while (load := _load(server))["num_running_reqs"] + load["num_waiting_reqs"] == 0:  # wait for the call to arrive
        assert thread.is_alive() and time.monotonic() < deadline, "the score call ended before it could be aborted"
        time.sleep(0.05)
    assert httpx.post(server.url + "/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
    thread.join(timeout=60)
    r = answer["r"]
    assert r.status_code == 400, r.text
    assert re.fullmatch(r"The score of item \d+ was not computed: .+", r.json()["error"]["message"]), r.text
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    load = wait_until_freed(server)
    assert load["num_running_reqs"] == load["num_waiting_reqs"] == load["num_used_tokens"] == 0


def test_native_generate_wrong_types_are_400_and_the_server_survives(server: Server, engine: Any) -> None:
    """These bodies used to crash the scheduler (2.5, "x") or run with a silently coerced value."""
    for params in ({"max_new_tokens": 2.5}, {"seed": "x"}, {"ignore_eos": "no"}, {"stop_token_ids": [1.5]}, {"stop": [""]}):
        r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": params}, timeout=60)
        assert r.status_code == 400 and next(iter(params)) in r.json()["error"]["message"], (params, r.text)
    assert httpx.get(server.url + "/health").status_code == 200
    ok = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):  # the in-process path too
        engine.generate("hi", {"max_new_tokens": 2.5})


def test_abort_request_refuses_a_non_boolean_abort_all(server: Server) -> None:
    """{"abort_all": "false"} is truthy: it must be a 400, not an abort of every client's request."""
    body = {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generating
        bad = httpx.post(server.url + "/abort_request", json={"abort_all": "false"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "abort_all"
        last = [json.loads(line[6:]) for line in lines if line.startswith("data: {")][-1]
    assert last["meta_info"]["finish_reason"]["type"] == "length" and last["meta_info"]["completion_tokens"] == 40


def test_abort_request_of_the_parent_rid_aborts_every_sample(server: Server) -> None:
    body = {"text": PROMPTS[0], "rid": "abort-n2", "stream": True,
            "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True, "n": 2}}  # fmt: skip
    finish: Dict[int, Any] = {}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break  # generating: abort by the rid the client chose
        assert httpx.post(server.url + "/abort_request", json={"rid": "abort-n2"}, timeout=10).status_code == 200
        for line in lines:
            if line.startswith("data: {"):
                out = json.loads(line[len("data: "):])
                if out["meta_info"]["finish_reason"] is not None:
                    finish[out["index"]] = out["meta_info"]
    assert sorted(finish) == [0, 1]
    assert all(m["finish_reason"]["type"] == "abort" and m["completion_tokens"] < 1500 for m in finish.values())


# --------------------------------------------------------------------------- concurrency, disconnect
def test_64_concurrent_streaming_clients(server: Server, reference: Dict[str, Any]) -> None:
    async def one(client: openai.AsyncOpenAI, p: str) -> str:
        stream = await client.completions.create(model=server.model, prompt=p, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> List[str]:
        client = _aclient(server, http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)))
        try:
            return await asyncio.gather(*(one(client, PROMPTS[i % len(PROMPTS)]) for i in range(64)))
        finally:
            await client.close()

    texts = asyncio.run(run())
    assert texts == [reference[("raw", PROMPTS[i % len(PROMPTS)])]["text"] for i in range(64)]


def _load(s: Server, headers: Dict[str, str] | None = None) -> Dict[str, Any]:
    return httpx.get(s.url + "/get_load", headers=headers, timeout=10).json()


def wait_until_freed(s: Server, headers: Dict[str, str] | None = None, timeout_s: float = 20) -> Dict[str, Any]:
    """/get_load once no request runs and no KV slot is used (a hung-up request's abort has run), or the
    last load seen when timeout_s passes first: the caller asserts on it."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = _load(s, headers)
        if (load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(0.2)


def _metric(s: Server, name: str, headers: Dict[str, str] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(s.url + "/metrics", headers=headers or {}, timeout=10).text
    return sum(sample.value for fam in text_string_to_metric_families(text) for sample in fam.samples if sample.name == name)


def test_client_disconnect_aborts_and_frees_kv(server: Server) -> None:
    aborted_before = _metric(server, "sglang:num_aborted_requests_total")
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # got a token: hang up mid-stream
    assert _load(server)["num_running_reqs"] <= 1
    load = wait_until_freed(server)
    assert load["num_running_reqs"] == 0 and load["num_used_tokens"] == 0 and load["token_usage"] == 0.0
    assert _metric(server, "sglang:num_aborted_requests_total") == aborted_before + 1


# --------------------------------------------------------------------------- bad input, metrics
@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"messages": []}, "Messages cannot be empty"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": 9.0}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
        ({"response_format": {"type": "structural_tag"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "Invalid json_schema"),
        ({"logit_bias": {"5": 1000.0}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, "context length"),
    ],
)
def test_bad_inputs_are_4xx_and_server_keeps_serving(server: Server, kwargs: Dict[str, Any], needle: str) -> None:
    client = _client(server)
    args: Dict[str, Any] = {"model": server.model, "messages": _chat_msgs("hi"), "max_tokens": 4}
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert needle in e.value.message
    assert httpx.get(server.url + "/health").status_code == 200
    ok = client.completions.create(model=server.model, prompt="ok", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_bad_json_unknown_model_and_wrong_types(server: Server) -> None:
    for route in ("/v1/chat/completions", "/v1/completions", "/generate"):
        r = httpx.post(server.url + route, content=b"{oops", headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400 and "not valid JSON" in error["message"]
        assert error["param"] is None  # (pydantic's location of a syntax error is a character offset)
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "x", "max_tokens": "many"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        _client(server).chat.completions.create(model="no-such-model", messages=_chat_msgs("x"), max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        _client(server).chat.completions.create(model=server.model, messages=_chat_msgs("word " * 3000), max_tokens=2, stream=True)


def test_metrics_parse_and_counters_move(server: Server) -> None:
    before = {n: _metric(server, n) for n in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                                              "sglang:e2e_request_latency_seconds_count", "sglang:time_to_first_token_seconds_count")}  # fmt: skip
    r = _client(server).completions.create(model=server.model, prompt=PROMPTS[2], max_tokens=4, temperature=0)
    after = {n: _metric(server, n) for n in before}
    assert after["sglang:prompt_tokens_total"] == before["sglang:prompt_tokens_total"] + r.usage.prompt_tokens
    assert after["sglang:generation_tokens_total"] == before["sglang:generation_tokens_total"] + r.usage.completion_tokens
    assert after["sglang:e2e_request_latency_seconds_count"] == before["sglang:e2e_request_latency_seconds_count"] + 1
    assert after["sglang:time_to_first_token_seconds_count"] == before["sglang:time_to_first_token_seconds_count"] + 1
    # the gauges are refreshed from the scheduler's load at each scrape (_metric reads 0 for a
    # missing name, so check they are there and carry the load's values)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    gauges = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate")
    assert set(gauges) | {"sglang:max_total_num_tokens", "sglang:gen_throughput"} <= names
    assert _metric(server, "sglang:max_total_num_tokens") == 8192  # --max-total-tokens of this server
    assert _metric(server, "sglang:num_running_reqs") == _metric(server, "sglang:num_queue_reqs") == 0  # idle
    assert _metric(server, "sglang:token_usage") == _load(server)["token_usage"]


def test_health_generate_runs_a_token_through_the_pipeline(server: Server) -> None:
    finished = _metric(server, "sglang:e2e_request_latency_seconds_count")
    assert httpx.get(server.url + "/health_generate", timeout=30).status_code == 200
    assert _metric(server, "sglang:e2e_request_latency_seconds_count") == finished  # a probe, not a request


def test_flush_cache(server: Server) -> None:
    _client(server).completions.create(model=server.model, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert _load(server)["evictable_tokens"] > 0  # something cached to flush
    assert httpx.post(server.url + "/flush_cache", timeout=10).status_code == 200
    load = _load(server)
    assert load["evictable_tokens"] == 0 and load["available_tokens"] == load["max_total_num_tokens"] == 8192


def test_freeze_gc_reaches_every_process_and_serving_goes_on(server: Server) -> None:
    """SGLang's /freeze_gc: HTTP, scheduler and detokenizer freeze their GC; an unknown message
    would have killed the detokenizer, so a request served afterwards proves it got there."""
    r = httpx.post(server.url + "/freeze_gc", timeout=10)
    assert r.status_code == 200 and "frozen" in r.json()["message"]
    out = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "after the freeze",
                                                           "max_tokens": 3}, timeout=30)  # fmt: skip
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_chat_template_flag_replaces_the_tokenizers_template(server: Server, server_dyn: Server) -> None:
    """server_dyn renders chat with --chat-template's file: a variable only that file reads is
    accepted there and changes the prompt; the tokenizer's own template (server) refuses it."""
    body = {"messages": _chat_msgs(PROMPTS[0]), "max_tokens": 1, "chat_template_kwargs": {"house_style": True}}
    headers = {"Authorization": "Bearer sekret"}
    styled = httpx.post(server_dyn.url + "/v1/chat/completions", json={**body, "model": server_dyn.model}, headers=headers, timeout=60)
    plain = httpx.post(server_dyn.url + "/v1/chat/completions", json={**body, "model": server_dyn.model, "chat_template_kwargs": None},
                       headers=headers, timeout=60)  # fmt: skip
    assert styled.status_code == plain.status_code == 200, styled.text
    assert styled.json()["usage"]["prompt_tokens"] > plain.json()["usage"]["prompt_tokens"]
    refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "model": server.model}, timeout=60)
    assert refused.status_code == 400 and "house_style" in refused.json()["error"]["message"]


def test_sigterm_shuts_everything_down_cleanly(server: Server) -> None:
    """Runs last among the `server` tests: it stops that server. A stream in flight ends as an
    abort with [DONE] (it was cancelled into a 500 with a traceback in the log)."""
    body = {"text": PROMPTS[0], "stream": True, "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generating
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert r.status_code == 200 and rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: "):])["meta_info"]["finish_reason"]["type"] == "abort"
    assert server.proc.wait(timeout=15) == 0
    for pid in server.pids.values():
        deadline = time.monotonic() + 5
        while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}"), f"child {pid} outlived the server"


# --------------------------------------------------------------------------- structured output
def test_the_openai_clients_parse_helper_gets_its_pydantic_object(server_dyn: Server) -> None:
    """client.chat.completions.parse sends a strict json_schema built from the model class and
    validates the answer against it: the whole OpenAI structured-output round trip."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=8)  # (a bound: a random model's unbounded integer runs to max_tokens)
        vaccinated: bool

    client = _client(server_dyn, api_key="sekret")
    r = client.chat.completions.parse(model=server_dyn.model, messages=_chat_msgs("A pet?"), response_format=Pet,
                                      max_tokens=128, temperature=0.8)  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")
    json_object = client.chat.completions.create(model=server_dyn.model, messages=_chat_msgs("JSON?"), max_tokens=64,
                                                 response_format={"type": "json_object"})  # fmt: skip
    choice = json_object.choices[0]
    if choice.finish_reason == "stop":  # (any object: a random model may still be inside it at max_tokens)
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.startswith("{")


def test_a_forced_tool_call_through_the_openai_client(server_dyn: Server) -> None:
    """Greedy, so both answers are one: the stream sends the call's id and name (arguments ""),
    then its arguments in pieces, which the SDK's stream helper puts together into exactly the
    non-streamed call (the server's JSON is compact, --constrained-json-disable-any-whitespace:
    both answers' arguments are json.dumps' normalised form of it)."""
    weather = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}  # fmt: skip
    client = _client(server_dyn, api_key="sekret")
    # (a random model spells the call a character per token at worst: ~60 tokens)
    args = dict(model=server_dyn.model, messages=_chat_msgs("Weather?"), max_tokens=128, tools=[weather], temperature=0,
                tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)  # fmt: skip
    choice = client.chat.completions.create(**args).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    with client.chat.completions.stream(**args) as stream:  # (the openai SDK's helper: it accumulates the deltas)
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    deltas = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert len(deltas) >= 3 and all(d.id is None and d.function.name is None for d in deltas[1:])  # (pieces as they came)
    (streamed,) = final.message.tool_calls
    assert final.finish_reason == "tool_calls" and (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed.function.parsed_arguments == json.loads(call.function.arguments)


# --------------------------------------------------------------------------- dynamic batch tokenizer, api key, crash
def test_dynamic_batch_tokenizer_concurrent_requests(server_dyn: Server, reference: Dict[str, Any]) -> None:
    assert httpx.get(server_dyn.url + "/v1/models").status_code == 401
    assert httpx.get(server_dyn.url + "/health").status_code == 200
    # the key as a query parameter opens the visualizer page (EventSource cannot send
    # headers), and nothing else
    assert httpx.get(server_dyn.url + "/v1/models", params={"api_key": "sekret"}).status_code == 401
    assert httpx.get(server_dyn.url + "/visualizer").status_code == 401
    assert httpx.get(server_dyn.url + "/visualizer", params={"api_key": "sekret"}).status_code == 200
    assert httpx.get(server_dyn.url + "/visualizer", params={"api_key": "wrong"}).status_code == 401

    async def run() -> List[str]:
        client = _aclient(server_dyn, api_key="sekret")
        try:
            rs = await asyncio.gather(*(
                client.chat.completions.create(model=server_dyn.model, messages=_chat_msgs(PROMPTS[i % 4]),
                                               max_tokens=MAX_TOKENS, temperature=0)
                for i in range(16)))  # fmt: skip
            return [r.choices[0].message.content for r in rs]
        finally:
            await client.close()

    assert asyncio.run(run()) == [reference[("chat", PROMPTS[i % 4])]["text"] for i in range(16)]


def test_killing_the_scheduler_exits_the_server_nonzero(server_dyn: Server) -> None:
    """A stream in flight ends with an error event naming the dead process and [DONE] (it was
    cancelled mid-chunk, with an ASGI traceback per request in the log)."""
    assert "scheduler" in server_dyn.pids
    body = {"model": server_dyn.model, "prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": "Bearer sekret"}
    with httpx.stream("POST", server_dyn.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))  # generating
        os.kill(server_dyn.pids["scheduler"], signal.SIGKILL)
        start = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and "scheduler" in error["message"] and "died" in error["message"]
    code = server_dyn.proc.wait(timeout=15)
    assert code != 0
    assert time.monotonic() - start < 10
    assert "Exception in ASGI application" not in server_dyn.read_log()


# --------------------------------------------------------------------------- the visualizer, live
@pytest.fixture(scope="module")
def server_viz(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("srv") / "server_viz.log")
    s = Server(tiny_model, log, "--visualize", "--api-key", "vk", "--max-running-requests", "1")
    yield s
    s.stop()


VIZ_AUTH = {"Authorization": "Bearer vk"}


def _viz_history(s: Server) -> Dict[str, Any]:
    return httpx.get(s.url + "/visualizer/history", params={"api_key": "vk"}, timeout=10).json()


def _settled_seq(s: Server) -> int:
    """The hub's last seq once nothing has been published for a second (a slow machine may
    publish the last step of the previous test late)."""
    last, since, deadline = -1, time.monotonic(), time.monotonic() + 30
    while True:
        seq = httpx.get(s.url + "/visualizer/history", params={"api_key": "vk", "limit": 0}, timeout=10).json()["last_seq"]
        if seq != last:
            last, since = seq, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            return seq
        assert time.monotonic() < deadline, "the visualizer kept publishing on an idle server"
        time.sleep(0.1)


def test_visualizer_with_api_key_loads_its_assets_and_streams(server_viz: Server) -> None:
    page = httpx.get(server_viz.url + "/visualizer", params={"api_key": "vk"}, timeout=10)
    assert page.status_code == 200
    assets = re.findall(r'(?:src|href)="(/visualizer/static/[^"]+)"', page.text)
    assert sorted(assets) == ["/visualizer/static/visualizer.css", "/visualizer/static/visualizer.js"]
    for url in assets:  # as a <script src> / <link href> asks: no header, no ?api_key
        assert httpx.get(server_viz.url + url, timeout=10).status_code == 200, url
    for route in ("/visualizer/events", "/visualizer/snapshot", "/visualizer/history"):
        assert httpx.get(server_viz.url + route, timeout=10).status_code == 401, route  # the data stays protected
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    assert httpx.post(server_viz.url + "/generate", json=body, headers=VIZ_AUTH, timeout=60).status_code == 200
    with httpx.stream("GET", server_viz.url + "/visualizer/events", params={"api_key": "vk"}, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = next(line for line in r.iter_lines() if line.startswith("data:"))
    assert json.loads(data[5:])["step"] >= 1


def test_visualizer_shows_arrivals_and_an_abort_while_waiting(server_viz: Server) -> None:
    import threading

    def generate(rid: str, n: int) -> None:
        body = {"text": "hi", "rid": rid, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        httpx.post(server_viz.url + "/generate", json=body, headers=VIZ_AUTH, timeout=120)

    threads = [threading.Thread(target=generate, args=("viz-A", 1500)), threading.Thread(target=generate, args=("viz-B", 4))]
    threads[0].start()

    def running() -> List[Dict[str, Any]]:  # (the snapshot is null before the server's first step)
        snap = httpx.get(server_viz.url + "/visualizer/snapshot", params={"api_key": "vk"}).json()
        return snap["running_batch"] if snap is not None else []

    deadline = time.monotonic() + 30
    while not any(r["rid"] == "viz-A" for r in running()):
        assert time.monotonic() < deadline, "viz-A never ran"
        time.sleep(0.05)
    threads[1].start()  # after A runs: with max_running_requests=1, B must wait
    deadline = time.monotonic() + 30
    while not any(w["rid"] == "viz-B" for w in httpx.get(server_viz.url + "/visualizer/snapshot", params={"api_key": "vk"}).json()["waiting_queue"]):
        assert time.monotonic() < deadline, "viz-B never waited (max_running_requests=1)"
        time.sleep(0.05)
    for rid in ("viz-B", "viz-A"):  # B while it waits, then A to end the test quickly
        assert httpx.post(server_viz.url + "/abort_request", json={"rid": rid}, headers=VIZ_AUTH).status_code == 200
    for t in threads:
        t.join(timeout=60)
    entries = _viz_history(server_viz)["entries"]
    events = {(ev["type"], ev["rid"]) for e in entries for ev in e["events"]}
    assert {("arrive", "viz-A"), ("arrive", "viz-B"), ("abort", "viz-B")} <= events
    [fin] = [f for e in entries for f in e["finished"] if f["rid"] == "viz-B"]
    assert fin["finish_reason"]["type"] == "abort" and fin["ttft_ms"] is None and fin["queue_ms"] is not None


def test_visualizer_idle_control_requests_publish_nothing(server_viz: Server) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(server_viz.url + "/get_load", headers=VIZ_AUTH).json()["num_running_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    last_seq = _settled_seq(server_viz)
    for _ in range(5):  # a dashboard polling an idle server
        assert httpx.get(server_viz.url + "/get_load", headers=VIZ_AUTH).status_code == 200
        assert httpx.get(server_viz.url + "/metrics", headers=VIZ_AUTH).status_code == 200
    time.sleep(0.5)
    assert _viz_history(server_viz)["last_seq"] == last_seq  # no republished step, so no duplicate bars
