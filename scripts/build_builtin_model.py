"""Build the built-in model that ships in minisgl/assets/builtin-model/.

Not part of the request chain: this script runs once, offline, and its output is
the model `minisgl serve` loads when no `--model` is given (server_args.BUILTIN_MODEL_DIR).
In: Python's own documentation text (`pydoc_data.topics`, shipped with every CPython).
Out: a Hugging Face model directory (Qwen3 architecture, bf16 safetensors, byte-level
BPE tokenizer with a chat template, README). Everything is seeded and the step count
is fixed, so the same Python and torch versions rebuild the same files; no network.

    python scripts/build_builtin_model.py            # ~300 steps, several minutes on 2 cores
    python scripts/build_builtin_model.py --steps 50 --out /tmp/quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from typing import Any, List, Sequence, Tuple

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from minisgl.server_args import BUILTIN_MODEL_DIR  # noqa: E402
from minisgl.test_utils import corpus_texts, train_tokenizer  # noqa: E402

VOCAB_SIZE = 4096
SEQ_LEN = 256
BATCH_SIZE = 16
CHAT_ROWS_PER_BATCH = 2  # 2 of 16 rows (12.5%) are chat-formatted samples
LR = 2e-3
MIN_LR_RATIO = 0.1  # cosine decays to 10% of the peak, not to zero
WARMUP_STEPS = 50
WEIGHT_DECAY = 0.05
LOG_EVERY = 25
SAMPLE_PROMPTS = ("The ", "chat:What does the assert statement do?")
# A sentence ends at . ! or ? followed by whitespace and a capital letter or a quote.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")


def model_config(tok: Any) -> Any:
    """Qwen3 with 4.2M parameters: big enough to write English, small enough for a wheel."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rope_theta=1e6,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )


def prose_paragraphs(texts: Sequence[str]) -> List[str]:
    """Paragraphs of running English: no code blocks (indented), no headings, no grammar."""
    paragraphs = []
    for text in texts:
        for block in text.split("\n\n"):
            if not block or block[0].isspace() or "***" in block or "===" in block or "---" in block:
                continue
            para = " ".join(line.strip() for line in block.splitlines())
            if len(para) >= 120 and ". " in para:
                paragraphs.append(para)
    return paragraphs


def chat_samples(paragraphs: Sequence[str], max_reply_chars: int = 300) -> List[str]:
    """User = a paragraph's first sentence; assistant = the sentences that follow it.

    Replies are short so `<|im_end|>` appears often enough to be learnt as the stop.
    """
    samples = []
    for para in paragraphs:
        sentences = _SENTENCE_END.split(para)
        if len(sentences) < 2:
            continue
        reply = sentences[1]
        for s in sentences[2:]:
            if len(reply) + 1 + len(s) > max_reply_chars:
                break
            reply += " " + s
        samples.append(
            f"<|im_start|>user\n{sentences[0]}<|im_end|>\n<|im_start|>assistant\n{reply}<|im_end|>\n"
        )
    return samples


def build_streams(tok: Any) -> Tuple[torch.Tensor, List[List[int]]]:
    """The doc stream (topics joined by <|endoftext|>) and the tokenized chat samples."""
    texts = corpus_texts()
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    doc_ids: List[int] = []
    for text in texts:
        doc_ids.extend(tok.encode(text))
        doc_ids.append(eot)
    chats = [tok.encode(s) for s in chat_samples(prose_paragraphs(texts))]
    return torch.tensor(doc_ids, dtype=torch.long), chats


def get_batch(doc_ids: torch.Tensor, chats: List[List[int]], rng: random.Random) -> torch.Tensor:
    """[BATCH_SIZE, SEQ_LEN + 1] token ids: random doc windows, then chat rows.

    A chat row starts at a sample boundary and packs consecutive samples, so every
    `<|im_start|>user` the model sees is a real start of a conversation.
    """
    rows = []
    for _ in range(BATCH_SIZE - CHAT_ROWS_PER_BATCH):
        start = rng.randrange(len(doc_ids) - SEQ_LEN - 1)
        rows.append(doc_ids[start : start + SEQ_LEN + 1])
    for _ in range(CHAT_ROWS_PER_BATCH):
        i = rng.randrange(len(chats))
        row: List[int] = []
        while len(row) < SEQ_LEN + 1:
            row.extend(chats[i % len(chats)])
            i += 1
        rows.append(torch.tensor(row[: SEQ_LEN + 1], dtype=torch.long))
    return torch.stack(rows)  # [BATCH_SIZE, SEQ_LEN + 1]


def lr_at(step: int, total_steps: int) -> float:
    """Linear warm-up for WARMUP_STEPS, then cosine from LR down to MIN_LR_RATIO * LR."""
    if step < WARMUP_STEPS:
        return LR * (step + 1) / WARMUP_STEPS
    progress = (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS)
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: Any, doc_ids: torch.Tensor, chats: List[List[int]], steps: int, seed: int) -> float:
    """AdamW on next-token cross-entropy; returns the mean loss of the last LOG_EVERY steps."""
    rng = random.Random(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no decay on norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
    )
    model.train()
    recent: List[float] = []
    t0 = time.time()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        batch = get_batch(doc_ids, chats, rng)  # [B, T + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [B, T, vocab]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        recent = (recent + [loss.item()])[-LOG_EVERY:]
        if (step + 1) % LOG_EVERY == 0 or step == 0:
            print(f"step {step + 1:4d}/{steps}  loss {loss.item():.3f}  "
                  f"lr {lr_at(step, steps):.2e}  {time.time() - t0:6.1f}s", flush=True)
    return sum(recent) / len(recent)


def sample(model: Any, tok: Any, prompt: str, seed: int, max_new_tokens: int = 60) -> str:
    """Temperature 0.8, top-k 40; a prompt starting with "chat:" goes through the chat template."""
    if prompt.startswith("chat:"):
        messages = [{"role": "user", "content": prompt[len("chat:"):]}]
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    input_ids = torch.tensor([tok.encode(prompt)])  # [1, prompt_len]
    torch.manual_seed(seed)
    out = model.generate(
        input_ids, do_sample=True, temperature=0.8, top_k=40, max_new_tokens=max_new_tokens
    )  # [1, prompt_len + new]
    return tok.decode(out[0, input_ids.shape[1]:], skip_special_tokens=False)


def builtin_tokenizer() -> Any:
    """The shipped tokenizer: trained here (seeded), with the shipped chat template.

    The template is the asset's own file, the one source of it: it renders `tools` and an
    assistant's `tool_calls` (docs/structured_output.md), which the tests' plain ChatML template
    (test_utils.CHAT_TEMPLATE) does not; a rebuild wrote that one and lost both. A plain chat
    renders the same under either, so the training data does not change."""
    tok = train_tokenizer(vocab_size=VOCAB_SIZE)
    with open(os.path.join(BUILTIN_MODEL_DIR, "chat_template.jinja")) as f:
        tok.chat_template = f.read()
    return tok


def save(model: Any, tok: Any, out_dir: str) -> None:
    """bf16 safetensors (tied embeddings are stored once), tokenizer, generation config."""
    os.makedirs(out_dir, exist_ok=True)
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.bos_token_id = None
    model.to(torch.bfloat16).save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    # transformers 5 writes rope_theta only inside rope_parameters and the dtype as
    # "dtype"; transformers 4.x (pyproject allows >=4.51) and simple loaders read the
    # flat keys, and would silently fall back to rope_theta 1e4. Write both spellings.
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    cfg["torch_dtype"] = cfg.get("dtype", "bfloat16")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    # transformers 5 names the fast tokenizer class "TokenizersBackend", which 4.x does not
    # know (AutoTokenizer raises, so the server cannot start); "PreTrainedTokenizerFast"
    # loads under both (5.x maps it to TokenizersBackend).
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tok_cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def write_readme(out_dir: str, cmd: str, steps: int, final_loss: float, n_params: int,
                 samples: List[Tuple[str, str]], seconds: float) -> None:
    size_mb = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)) / 1e6
    lines = [
        "# minisgl built-in model",
        "",
        "The model `minisgl serve` loads when no `--model` is given: a "
        f"{n_params / 1e6:.1f}M-parameter Qwen3-architecture decoder (hidden 256, 4 layers, "
        "4 heads, 2 KV heads, head_dim 64, tied embeddings) with a byte-level BPE tokenizer "
        f"(vocab {VOCAB_SIZE}) and a chat template. It is a teaching toy: it writes "
        "Python-documentation-like English, not correct answers.",
        "",
        "## How it was made",
        "",
        "Trained from scratch on this machine's CPU, offline, by",
        "",
        f"    {cmd}",
        "",
        f"on `pydoc_data.topics` (Python {sys.version.split()[0]}) plus {CHAT_ROWS_PER_BATCH} of "
        f"{BATCH_SIZE} rows per batch of chat-formatted samples (a paragraph's first sentence as "
        "the user turn, the following sentences as the assistant turn, ended by `<|im_end|>`). "
        f"AdamW lr {LR}, {WARMUP_STEPS}-step warm-up, cosine decay to {MIN_LR_RATIO:g}x, weight "
        f"decay {WEIGHT_DECAY}, batch {BATCH_SIZE} x {SEQ_LEN} tokens, {steps} steps "
        f"({seconds:.0f} s). Final training loss (mean of the last {LOG_EVERY} steps): "
        f"{final_loss:.2f}. Weights stored in bfloat16; directory size {size_mb:.1f} MB. "
        "eos = `<|im_end|>`.",
        "",
        "## Samples (temperature 0.8, top-k 40)",
        "",
    ]
    for prompt, text in samples:
        lines += [f"Prompt `{prompt!r}`:", "", "    " + text.replace("\n", "\n    "), ""]
    lines += [
        "## License",
        "",
        "The training text is Python's documentation (`pydoc_data.topics`), "
        "Copyright Python Software Foundation, under the PSF License Agreement; "
        "these weights are derived from it and distributed under the same terms.",
        "",
    ]
    with open(os.path.join(out_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default=BUILTIN_MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    tok = builtin_tokenizer()
    doc_ids, chats = build_streams(tok)
    print(f"corpus: {len(doc_ids)} doc tokens, {len(chats)} chat samples", flush=True)
    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(model_config(tok))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    t0 = time.time()
    final_loss = train(model, doc_ids, chats, args.steps, args.seed)
    seconds = time.time() - t0
    save(model, tok, args.out)
    # Sample from what ships: the bf16 weights, read back and run in float32.
    shipped = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
    samples = [(p, sample(shipped, tok, p, args.seed)) for p in SAMPLE_PROMPTS]
    for prompt, text in samples:
        print(f"--- {prompt!r}\n{text}", flush=True)
    cmd = "python scripts/build_builtin_model.py" + ("" if args.steps == 300 else f" --steps {args.steps}")
    write_readme(args.out, cmd, args.steps, final_loss, n_params, samples, seconds)
    print(json.dumps({"final_loss": round(final_loss, 3), "out": args.out}), flush=True)


if __name__ == "__main__":
    main()
