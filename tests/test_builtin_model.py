"""The built-in model (minisgl/assets/builtin-model/) loads offline and writes English.

These checks use transformers only, so they hold whatever state the engine is in;
they guard the shipped files, which scripts/build_builtin_model.py produces.
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any, Set, Tuple

import pytest
import torch

from minisgl.server_args import BUILTIN_MODEL_DIR
from minisgl.test_utils import corpus_texts

MAX_DIR_BYTES = 10 * 1000 * 1000
# "The" without the space is how a tokenizer normally sees it; "The " ends in a lone
# space token the model rarely saw in training, so its continuation is weaker.
PROMPTS = ("The ", "The", "An exception ", "If the ")


def english_fraction(text: str) -> float:
    """Share of characters that are ASCII letters or spaces."""
    return sum(c == " " or (c.isascii() and c.isalpha()) for c in text) / max(1, len(text))


@functools.lru_cache(maxsize=1)
def corpus_words() -> Set[str]:
    return {w.lower() for text in corpus_texts() for w in re.findall(r"[A-Za-z]+", text)}


def is_english_like(text: str) -> bool:
    """Mostly letters and spaces, made of real words, and not one word on repeat.

    The letter share alone is not enough: random weights over a BPE vocabulary of
    English sub-words emit "vesvesvesmentation..." or "blocks blocks blocks ...",
    which is 97-100% letters (measured on four random seeds). Requiring 4 distinct
    words, 80% of them words of the corpus, rejects both.
    """
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    known = sum(w in corpus_words() for w in words) / max(1, len(words))
    return english_fraction(text) >= 0.7 and len(set(words)) >= 4 and known >= 0.8


def greedy_continuation(model: Any, tok: Any, prompt: str, n: int = 20) -> str:
    input_ids = torch.tensor([tok.encode(prompt)])  # [1, prompt_len]
    with torch.no_grad():
        out = model.generate(input_ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return tok.decode(out[0, input_ids.shape[1]:])  # [n] new tokens -> text


def mean_nll(model: Any, tok: Any, text: str) -> float:
    """Next-token cross-entropy in nats over `text` (ln(4096) = 8.3 is a uniform guess)."""
    ids = torch.tensor([tok.encode(text)[:256]])  # [1, T]
    with torch.no_grad():
        return model(input_ids=ids, labels=ids).loss.item()


@pytest.fixture(scope="module")
def builtin() -> Tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        BUILTIN_MODEL_DIR, local_files_only=True, dtype=torch.float32
    ).eval()
    return tok, model


def random_model(seed: int) -> Any:
    """Same config as the built-in model, freshly initialised weights: an untrained twin."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(BUILTIN_MODEL_DIR, local_files_only=True)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def test_directory_is_small_and_complete() -> None:
    files = os.listdir(BUILTIN_MODEL_DIR)
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "README.md"):
        assert name in files
    total = sum(os.path.getsize(os.path.join(BUILTIN_MODEL_DIR, f)) for f in files)
    assert total < MAX_DIR_BYTES


def test_files_load_under_transformers_4() -> None:
    """pyproject allows transformers>=4.51 for the engine: the shipped files must not name
    what only transformers 5 knows (its "TokenizersBackend" class made AutoTokenizer raise
    under 4.51, so `minisgl serve` could not start), nor keep rope_theta only where 5 puts it."""
    with open(os.path.join(BUILTIN_MODEL_DIR, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    with open(os.path.join(BUILTIN_MODEL_DIR, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["rope_theta"] == 1e6 and cfg["torch_dtype"] == "bfloat16"


def test_eos_is_im_end(builtin: Tuple[Any, Any]) -> None:
    tok, model = builtin
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    assert model.config.eos_token_id == im_end
    assert model.generation_config.eos_token_id == im_end


def test_chat_template_renders_assistant_turn(builtin: Tuple[Any, Any]) -> None:
    tok, _ = builtin
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"


def test_architecture_matches_the_design(builtin: Tuple[Any, Any]) -> None:
    _, model = builtin
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.vocab_size == 4096
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim) == (256, 4, 4, 2, 64)
    assert cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 1e6


def english_prompts_passed(model: Any, tok: Any) -> int:
    """How many PROMPTS get an English-like greedy 20-token continuation."""
    return sum(is_english_like(greedy_continuation(model, tok, p)) for p in PROMPTS)


def test_greedy_text_is_english_like(builtin: Tuple[Any, Any]) -> None:
    # Measured on the shipped weights: all 4 pass ("The " scores exactly 0.70, the
    # others 0.84-0.93), so one prompt may flip on a different BLAS without failing.
    tok, model = builtin
    assert english_prompts_passed(model, tok) >= 3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_weights_fail_the_english_check(builtin: Tuple[Any, Any], seed: int) -> None:
    # Keeps the check above honest: an untrained model of the same shape and
    # tokenizer must not pass it.
    tok, _ = builtin
    assert english_prompts_passed(random_model(seed), tok) <= 1


def test_trained_model_predicts_python_docs(builtin: Tuple[Any, Any]) -> None:
    # An untrained model sits near ln(4096) = 8.3 nats; the shipped one learnt the corpus.
    tok, model = builtin
    passage = corpus_texts()[0]
    assert mean_nll(random_model(0), tok, passage) > 7.5
    assert mean_nll(model, tok, passage) < 4.5


def test_chat_template_shows_tools_and_earlier_calls_in_the_forced_call_format(builtin: Tuple[Any, Any]) -> None:
    """The built-in template renders `tools` and an assistant's `tool_calls` (as the JSON array a
    forced call writes, docs/structured_output.md), so a tool loop's second turn runs on it."""
    tok, _ = builtin
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]  # fmt: skip
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text == (
        '<|im_start|>system\nTools: [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]<|im_end|>\n'
        "<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n[{"name": "get_weather", "parameters": {"city": "Zürich"}}]<|im_end|>\n'
        "<|im_start|>tool\n18C<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_build_script_writes_the_shipped_tokenizer_and_template() -> None:
    """A rebuild (docs/builtin_model.md) wrote the tests' plain ChatML template over the shipped
    one, which renders tools: the tool-call loop the docs describe then broke on the rebuilt model."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "build_builtin_model.py")
    spec = importlib.util.spec_from_file_location("build_builtin_model", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    tok = script.builtin_tokenizer()
    with open(os.path.join(BUILTIN_MODEL_DIR, "chat_template.jinja")) as f:
        assert tok.chat_template == f.read()
    from transformers import AutoTokenizer

    shipped = AutoTokenizer.from_pretrained(BUILTIN_MODEL_DIR)
    assert tok.get_vocab() == shipped.get_vocab()
    plain = [{"role": "user", "content": "Hello"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert "get_weather" in tok.apply_chat_template(plain, tools=tools, tokenize=False, add_generation_prompt=True)
