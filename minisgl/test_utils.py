"""Offline model factory for tests, benchmarks and the built-in model script.

Nothing here downloads: the tokenizer is a byte-level BPE trained in well under a
second on Python's own documentation (`pydoc_data.topics`), and models are Hugging Face
configs with random weights saved with `save_pretrained`. A byte-level BPE splits
multi-byte characters across tokens, which is what the detokenizer tests need.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Iterable, List, Optional

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# short name -> transformers' config and model classes: one entry per supported architecture
# (models/registry.py has the engine's side; docs/model_execution.md, "Adding an architecture")
TRANSFORMERS_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# Tiny mixture-of-experts shapes: 4 experts, top-2, so that in a batch of a few tokens some
# experts get several tokens and some none. Qwen3-MoE has a dense middle layer (mlp_only_layers)
# and renormalises its top-2; Qwen2-MoE keeps transformers' default (no renormalisation) and
# has a shared expert; Mixtral always renormalises and its experts are intermediate_size wide.
MOE_OVERRIDES: Dict[str, Dict[str, Any]] = {
    "qwen3_moe": dict(num_hidden_layers=3, mlp_only_layers=[1], num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=96),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
}  # fmt: skip
ARCHITECTURES = tuple(TRANSFORMERS_CLASSES)


def corpus_texts() -> List[str]:
    """~0.5 MB of English technical prose that ships with every CPython."""
    import pydoc_data.topics as topics

    return list(topics.topics.values())


def train_tokenizer(vocab_size: int = 2048, texts: Optional[Iterable[str]] = None) -> Any:
    """A byte-level BPE with <|im_start|>/<|im_end|> and a chat template, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts) if texts is not None else corpus_texts(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
    )


def train_byte_fallback_tokenizer(vocab_size: int = 600) -> Any:
    """A SentencePiece-style BPE as Llama-2 and Mistral ship it: words marked with U+2581,
    characters outside the vocabulary spelled as byte tokens <0xNN> (byte fallback), and
    their decoder chain (the marker back to a space, bytes fused, the first space stripped).

    Unlike a byte-level BPE, its decode drops a leading space and turns a whole run of byte
    tokens into U+FFFD when the run starts inside a character: the cases the detokenizer's
    left context and the scheduler's stop-string tail must get right. Trained on English
    only, so CJK and emoji always take the byte path.
    """
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, limit_alphabet=64, show_progress=False)
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    draft.train_from_iterator(corpus_texts()[:200], trainer)
    # the same merges over a vocabulary that also holds the 256 byte tokens, right after the specials
    vocab = {name: i for i, name in enumerate(specials)}
    vocab.update({f"<0x{b:02X}>": len(specials) + b for b in range(256)})
    for piece, _ in sorted(draft.get_vocab().items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    draft_merges = json.loads(draft.to_str())["model"]["merges"]  # "a b" strings or [a, b] pairs
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in draft_merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(name, special=True) for name in specials])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", model_max_length=1 << 20
    )


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(vocab_size: int) -> Any:
    return train_tokenizer(vocab_size)


def make_config(arch: str, vocab_size: int, **overrides: Any) -> Any:
    """A tiny config of a supported architecture (ARCHITECTURES; float32, random init)."""
    import transformers as tf

    base: Dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=2,  # <|im_end|>
        pad_token_id=0,
        bos_token_id=None,
    )
    if arch == "qwen3":
        base["head_dim"] = 32
        base["tie_word_embeddings"] = True
    base.update(MOE_OVERRIDES.get(arch, {}))
    base.update(overrides)
    return getattr(tf, TRANSFORMERS_CLASSES[arch][0])(**base)


def make_tiny_model(
    path: str,
    arch: str = "qwen3",
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    init_std: float = 0.1,
    **config_overrides: Any,
) -> str:
    """Write a random-weight model + tokenizer to `path` and return it.

    `init_std` is larger than HF's default 0.02 so random logits are not nearly flat:
    greedy parity tests then compare well-separated argmaxes.
    """
    import torch
    import transformers as tf

    os.makedirs(path, exist_ok=True)
    tok = _cached_tokenizer(vocab_size)
    cfg = make_config(arch, vocab_size=len(tok), initializer_range=init_std, **config_overrides)
    cls = getattr(tf, TRANSFORMERS_CLASSES[arch][1])
    torch.manual_seed(seed)
    model = cls(cfg).to(getattr(torch, dtype))
    model.generation_config.eos_token_id = cfg.eos_token_id
    model.generation_config.pad_token_id = cfg.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
