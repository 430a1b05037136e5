"""ServerArgs: every engine option in one frozen dataclass, built once and resolved once.

Where it sits: the CLI (`minisgl serve`, `minisgl generate`) and `minisgl.Engine(...)`
build a `ServerArgs`, call `resolve_server_args` once to fill every "auto" value, and
hand the resolved object to every process. Nothing mutates it afterwards: the
dataclass is frozen, and resolution returns a new object (`dataclasses.replace`).

Flag names follow SGLang (`--model-path`/`--model`, `--page-size`, `--chunked-prefill-size`,
...), so a reader can move between `sglang.launch_server --help` and `minisgl serve --help`.
The argparse parser is generated from the dataclass fields, so a new option is one field.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Sequence, Tuple

from minisgl.chat_template import read_chat_template
from minisgl.lora.lora_config import SUPPORTED_TARGET_MODULES, parse_lora_paths

logger = logging.getLogger(__name__)

_DEFAULT_CPU_KV_CACHE_GB = 1.0
DEFAULT_DIST_TIMEOUT_S = 1800  # --dist-timeout's default: torch.distributed's 30 minutes
# SGLang options that ask for what minisgl always does: `serve` takes them as flags and the
# Engine as keywords, so SGLang launch lines and scripts run, and each is said at start
SGLANG_OPTIONS_ALREADY_SO = {
    "enable_metrics": "metrics are always on (the server's /metrics; the Engine's get_load() and meta_info)",
    "enable_cache_report": "cached_tokens is always reported (usage.prompt_tokens_details; the Engine's meta_info)",
    "disable_overlap_schedule": "minisgl's scheduler never overlaps a step's scheduling with the forward",
}
# SGLang options for what minisgl does not build: `serve` refuses the flag and the Engine the
# keyword (None, SGLang's default, asks for nothing and is taken), each with why and what to do
SGLANG_OPTIONS_REFUSED = {
    "multi_item_scoring_delimiter": (
        "SGLang's multi-item scoring (all items of a /v1/score call in one sequence, split by this delimiter "
        "token under a custom attention mask) is not built in minisgl: /v1/score and Engine.score score each "
        "item as its own request in one batch; leave the option out"
    ),
}
# The options of `minisgl serve`'s HTTP server and its processes: the in-process Engine has
# neither, so it refuses them (log_level it applies to its loggers).
SERVER_ONLY_FIELDS = (
    "host", "port", "api_key", "visualize", "enable_dynamic_batch_tokenizer", "soft_watchdog_timeout",
    "watchdog_timeout", "log_requests", "served_model_name",
    "tool_call_parser", "reasoning_parser", "chat_template",  # (the chat route's: the Engine has no chat)
)  # fmt: skip

# The built-in model ships inside the package (DESIGN.md, "The built-in model").
BUILTIN_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "builtin-model")

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
GRAMMAR_BACKENDS = ("xgrammar", "none")
RETRACTION_POLICIES = ("length", "priority")  # (SGLang 0.5.23's --retraction-policy)
# SGLang's --radix-eviction-policy (mem_cache/radix_cache.py: EVICTION_KEYS)
RADIX_EVICTION_POLICIES = ("lru", "mru", "lfu", "fifo", "filo", "priority")
TOOL_CALL_PARSERS = ("qwen25", "llama3", "mistral", "pythonic", "qwen3_coder")  # (entrypoints/openai/tool_parsers.py)
REASONING_PARSERS = ("qwen3", "deepseek-r1")  # (entrypoints/openai/reasoning.py)
DEFAULT_MAX_LORAS_PER_BATCH = 8  # SGLang's default
SPECULATIVE_ALGORITHMS = ("NGRAM",)  # (speculative/ngram_worker.py; SGLang's draft-model algorithms are not built)
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
KV_CACHE_DTYPES = ("auto", "bfloat16", "bf16")  # SGLang's names (its fp8 ones need a GPU kernel minisgl lacks)


def _opt(help: str, *flags: str, **meta: Any) -> dict:
    """Field metadata: help text, extra flag aliases, and argparse extras (choices...)."""
    return {"help": help, "flags": flags, **meta}


@dataclass(frozen=True)
class ServerArgs:
    # --- model and tokenizer ---
    model_path: Optional[str] = field(
        default=None,
        metadata=_opt("Model directory or Hugging Face hub id. Default: the built-in model.", "--model"),
    )
    tokenizer_path: Optional[str] = field(default=None, metadata=_opt("Tokenizer path. Default: the model path.", "--tokenizer"))
    weight_version: str = field(
        default="default", metadata=_opt(
            "The served weights' version name (SGLang's): meta_info['weight_version'], /get_weight_version; a weight "
            "update may give the new weights another."
        )
    )
    served_model_name: Optional[str] = field(
        default=None, metadata=_opt("Model name reported by /v1/models. Default: the model path (minisgl-builtin for the built-in model).")
    )
    context_length: Optional[int] = field(default=None, metadata=_opt("Maximum context length. Default: from the model config."))
    trust_remote_code: bool = field(default=False, metadata=_opt("Allow custom code in the tokenizer directory."))
    is_embedding: bool = field(
        default=False,
        metadata=_opt(
            "Serve the model as an embedding model (SGLang's): a request is only prefilled, and its embedding is the "
            "final-norm hidden state at its last prompt token, L2-normalised (/v1/embeddings, /encode, Engine.encode). "
            "The generation routes are refused."
        ),
    )

    # --- device and dtype ---
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=_opt("cpu, cuda, or auto (cuda when available).", choices=DEVICES))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(
        default="auto", metadata=_opt("Model dtype. auto = float32 on CPU, bfloat16 on CUDA.", choices=DTYPES)
    )
    attention_backend: str = field(
        default="auto", metadata=_opt(
            "cpu (C decode kernel), torch, triton, or auto (triton on CUDA; cpu on CPU in float32 when a C "
            "compiler is found, else torch).",
            choices=ATTENTION_BACKENDS,
        )
    )
    disable_cuda_graph: bool = field(
        default=False, metadata=_opt("CUDA: run decode steps eagerly, kernel by kernel, instead of replaying captured CUDA graphs.")
    )
    cuda_graph_max_bs: Optional[int] = field(
        default=None, metadata=_opt(
            "CUDA: the largest decode batch replayed from a captured graph (SGLang's sizes 1, 2, 4, 8, 12, 16, 24, ... "
            "up to it are captured at start); larger batches run eagerly. Default: 256, at most --max-running-requests."
        )
    )
    tp_size: int = field(default=1, metadata=_opt(
        "Tensor-parallel size: this many scheduler processes (ranks), each holding 1/N of every layer's weights "
        "and heads; rank 0 reads the requests and hands them to the others each step, so all schedule alike. On "
        "the CPU the ranks share the cores: each runs max(1, torch's threads // N) threads (docs/parallelism.md).", "--tp"))
    dist_timeout: Optional[int] = field(default=None, metadata=_opt(
        "--tp-size > 1: seconds a rank waits at start-up's rendezvous and in any collective before it gives up "
        "and the server exits (a rank that died is noticed at once; this bounds one that hangs). An idle rank 0 "
        f"wakes the others well within it. Default: {DEFAULT_DIST_TIMEOUT_S} (torch's)."))
    random_seed: int = field(default=0, metadata=_opt("Seed of unseeded sampling (the ModelRunner's own generator) and of the random schedule policy.", "--seed"))

    # --- memory ---
    page_size: int = field(default=1, metadata=_opt("Tokens per KV page."))
    kv_cache_dtype: str = field(
        default="auto", metadata=_opt(
            "KV pool dtype: auto (the model's), or bfloat16 (bf16) under a float32 model: half the memory per "
            "token and half the bytes each decode step reads, K/V rounded to bf16 (cpu and torch backends).",
            choices=KV_CACHE_DTYPES,
        )
    )
    max_total_tokens: Optional[int] = field(default=None, metadata=_opt("KV pool size in tokens. Default: from memory."))
    mem_fraction_static: Optional[float] = field(
        default=None, metadata=_opt("CUDA: fraction of GPU memory for weights + KV pool. Default 0.85.")
    )
    cpu_kv_cache_gb: float = field(
        default=_DEFAULT_CPU_KV_CACHE_GB, metadata=_opt("CPU: KV pool budget in GiB when --max-total-tokens is unset (at most 8 full contexts are allocated).")
    )
    max_running_requests: Optional[int] = field(
        default=None, metadata=_opt("Request slots (rows of req_to_token). Default: from the pool, at most 256 on CPU (2048-4096 on CUDA).")
    )
    disable_radix_cache: bool = field(default=False, metadata=_opt("Turn the prefix (radix) cache off."))
    radix_eviction_policy: str = field(
        default="lru",
        metadata=_opt(
            "Which cached prefixes the radix cache frees first when memory is short: lru (least recently used), mru, "
            "lfu (reused by the fewest admitted requests, then lru), fifo (oldest), filo, or priority (those of the least important requests, then lru; needs "
            "--enable-priority-scheduling).",
            choices=RADIX_EVICTION_POLICIES,
        ),
    )

    # --- scheduling ---
    schedule_policy: str = field(default="fcfs", metadata=_opt("Waiting-queue order.", choices=SCHEDULE_POLICIES))
    enable_priority_scheduling: bool = field(
        default=False,
        metadata=_opt(
            "Requests may carry a priority: the waiting queue is ordered by it first (then by the policy), and a "
            "waiting request may preempt running ones less important by more than --priority-scheduling-preemption-threshold."
        ),
    )
    schedule_low_priority_values_first: bool = field(
        default=False, metadata=_opt("With priority scheduling, a lower priority value is more important (default: a higher one).")
    )
    priority_scheduling_preemption_threshold: int = field(
        default=10, metadata=_opt("How much more important a waiting request must be than a running one to preempt it.")
    )
    retraction_policy: str = field(
        default="length",
        metadata=_opt(
            "Which running requests go back to the queue first when the KV pool is full: length (the fewest output "
            "tokens, then the longest prompt) or priority (the least important, then length; needs --enable-priority-scheduling).",
            choices=RETRACTION_POLICIES,
        ),
    )
    chunked_prefill_size: Optional[int] = field(
        default=None, metadata=_opt("Max prompt tokens per prefill batch, shared by its requests; a longer prompt is split into chunks (-1 disables chunking). Default: 2048 CPU, 8192 CUDA.")
    )
    max_prefill_tokens: int = field(default=16384, metadata=_opt("Max tokens per prefill batch (the first request may exceed it)."))
    prefill_max_requests: Optional[int] = field(default=None, metadata=_opt("Max requests admitted per prefill batch."))
    enable_mixed_chunk: bool = field(default=False, metadata=_opt("Let decoding requests ride in prefill batches."))
    schedule_conservativeness: float = field(default=1.0, metadata=_opt("Scales the initial new_token_ratio."))
    max_queued_requests: Optional[int] = field(default=None, metadata=_opt("Reject new requests (503) above this queue length."))
    allow_auto_truncate: bool = field(default=False, metadata=_opt("Truncate over-long prompts instead of rejecting them."))
    stream_interval: int = field(default=1, metadata=_opt("Stream every N tokens."))
    incremental_streaming_output: bool = field(
        default=False, metadata=_opt("Streams of /generate and the Engine send what each chunk adds (text, ids, logprobs), not everything so far.")
    )
    decode_log_interval: int = field(default=40, metadata=_opt("Log a decode line every N decode steps."))

    # --- structured output ---
    grammar_backend: str = field(
        default="xgrammar", metadata=_opt("Grammar backend of structured output (json_schema, regex, ebnf): xgrammar, or none to refuse such requests.", choices=GRAMMAR_BACKENDS)
    )
    chat_template: Optional[str] = field(
        default=None, metadata=_opt(
            "A Jinja chat template file that /v1/chat/completions renders messages with, in place of the tokenizer's "
            "own (a base model's tokenizer has none)."
        )
    )
    tool_call_parser: Optional[str] = field(
        default=None, metadata=_opt(
            'Parse tool calls in the model\'s own format for tool_choice "auto": qwen25 (Qwen2.5/Qwen3\'s <tool_call>), '
            "llama3 (Llama 3.1/3.2's JSON calls, <|python_tag|>), mistral (Mistral's [TOOL_CALLS]), pythonic "
            "(Llama 3.2/4's [f(x=1)], when the template asks for it) or qwen3_coder (Qwen3-Coder's <function=...>).",
            choices=TOOL_CALL_PARSERS,
        )
    )
    reasoning_parser: Optional[str] = field(
        default=None, metadata=_opt("Put a thinking model's <think>...</think> in the chat answer's reasoning_content: qwen3 or deepseek-r1.", choices=REASONING_PARSERS)
    )
    constrained_json_disable_any_whitespace: bool = field(
        default=False, metadata=_opt('JSON-schema outputs allow only the separators ", " and ": " between JSON tokens (no free whitespace).')
    )
    enable_custom_logit_processor: bool = field(
        default=False, metadata=_opt(
            "Accept requests' custom_logit_processor (CustomLogitProcessor.to_str()). Off by default: loading one "
            "unpickles it, which runs the code the client sent on this server; turn it on only where every client may."
        )
    )

    # --- speculative decoding ---
    speculative_algorithm: Optional[str] = field(
        default=None, metadata=_opt(
            "Speculative decoding: NGRAM guesses each running request's next tokens from an earlier occurrence of its "
            "last tokens in its own prompt and output, and one forward checks them all; the output is what decoding "
            "one token at a time gives (docs/scheduler.md).",
            choices=SPECULATIVE_ALGORITHMS,
        )
    )
    speculative_num_draft_tokens: int = field(
        default=4, metadata=_opt("Tokens per request in a verify pass, the last sampled token included (so at most N - 1 guesses).")
    )
    speculative_ngram_min_match_window_size: int = field(
        default=1, metadata=_opt("NGRAM: the shortest suffix of a request's tokens whose earlier occurrence makes a draft.")
    )
    speculative_ngram_max_match_window_size: int = field(
        default=12, metadata=_opt("NGRAM: the longest suffix matched (the longest match among the last token's 64 latest occurrences wins).")
    )

    # --- LoRA (multi-adapter serving, minisgl/lora/) ---
    enable_lora: bool = field(
        default=False, metadata=_opt(
            "Serve LoRA adapters, and let /load_lora_adapter load more while serving (on by itself with "
            "--lora-paths). Without --lora-paths, give --max-lora-rank and --lora-target-modules too."
        )
    )
    lora_paths: Optional[Tuple[str, ...]] = field(
        default=None, metadata=_opt(
            "LoRA adapters loaded at start: NAME=PATH, or PATH (named by itself), PEFT save_pretrained "
            "directories. A request picks one with lora_path (or model \"BASE:NAME\" on the OpenAI routes).",
            nargs="+",
        )
    )
    # filled by resolve_server_args from lora_paths (not a flag): ((name, directory), ...) in the
    # order given, what the ModelRunner loads and the TokenizerManager's and the Engine's
    # LoRARegistry start with
    lora_adapters: Optional[Tuple[Tuple[str, str], ...]] = field(
        default=None, metadata=_opt("(resolved from --lora-paths; not a flag)", resolved=True)
    )
    max_lora_rank: Optional[int] = field(
        default=None, metadata=_opt("The largest rank (r) of an adapter loaded while serving. Default: the largest of --lora-paths.")
    )
    lora_target_modules: Optional[Tuple[str, ...]] = field(
        default=None, metadata=_opt(
            "The modules an adapter loaded while serving may target: some of q_proj k_proj v_proj o_proj "
            "gate_proj up_proj down_proj, or all. Default: those the --lora-paths adapters target.",
            nargs="+",
        )
    )
    max_loaded_loras: Optional[int] = field(
        default=None, metadata=_opt("Most adapters loaded at once, --lora-paths included: a load past it is refused. Default: no limit.")
    )
    max_loras_per_batch: int = field(
        default=DEFAULT_MAX_LORAS_PER_BATCH, metadata=_opt("Most distinct adapters one batch runs (the base model counts as one, as in SGLang).")
    )

    enable_return_hidden_states: bool = field(
        default=False, metadata=_opt(
            "Accept requests' return_hidden_states (SGLang's): the model's final-norm hidden state of every token it "
            "computes for the request comes back in meta_info[\"hidden_states\"] (docs/server.md). Off by default: "
            "each token costs hidden_size floats, ~20 bytes of JSON each, on every hop to the client."
        )
    )

    # --- server ---
    host: str = field(default="127.0.0.1", metadata=_opt("HTTP host."))
    port: int = field(default=30000, metadata=_opt("HTTP port (0 picks a free one)."))
    api_key: Optional[str] = field(default=None, metadata=_opt("Require `Authorization: Bearer KEY` on every route but /health, /health_generate, /metrics and the visualizer's static files."))
    visualize: bool = field(default=False, metadata=_opt("Serve the live scheduler visualizer at /visualizer."))
    enable_dynamic_batch_tokenizer: bool = field(default=False, metadata=_opt("Tokenize concurrent single texts in one batched call."))
    soft_watchdog_timeout: Optional[float] = field(default=None, metadata=_opt("Log when one loop iteration takes longer (seconds)."))
    watchdog_timeout: float = field(default=300.0, metadata=_opt("Exit when a forward makes no progress for this long (seconds)."))
    log_level: str = field(default="info", metadata=_opt("Logging level: debug, info, warning, error or critical (any case)."))
    log_requests: bool = field(default=False, metadata=_opt("Log every request's inputs and outputs."))

    def __post_init__(self) -> None:
        # Validation only: no mutation (STYLE.md habit 5); the one read is --chat-template's file, checked here
        # so that a missing file or a typo fails the start, not every chat request.
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.tp_size < 1:
            raise ValueError(f"--tp-size must be >= 1, got {self.tp_size}")
        if self.dist_timeout is not None and (isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, int) or self.dist_timeout < 1):
            raise ValueError(f"--dist-timeout must be a whole number of seconds >= 1, got {self.dist_timeout!r}")
        if self.tp_size > 1 and self.enable_custom_logit_processor:
            # every rank would run the client's code on its own copy of the logits: code that reads a clock,
            # draws random numbers or keeps state would make the ranks sample different tokens, and
            # schedulers that disagree run different batches into the same collectives
            raise ValueError(
                "--enable-custom-logit-processor runs each request's processor on every tensor-parallel rank, and a "
                "processor that is not deterministic would put the ranks out of step: use --tp-size 1 with it"
            )
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size * 2:
            raise ValueError(f"--max-total-tokens must hold at least two pages, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES + DTYPES[1:]:  # (resolved: the concrete dtype)
            raise ValueError(
                f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r} "
                "(fp8 KV caches need GPU kernels minisgl does not have)"
            )
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1, got {self.stream_interval}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.retraction_policy not in RETRACTION_POLICIES:
            raise ValueError(f"--retraction-policy must be one of {', '.join(RETRACTION_POLICIES)}, got {self.retraction_policy!r}")
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")
        if self.chat_template is not None:
            read_chat_template(self.chat_template)  # (a missing file or a syntax error fails the start)
        if self.radix_eviction_policy not in RADIX_EVICTION_POLICIES:
            raise ValueError(f"--radix-eviction-policy must be one of {', '.join(RADIX_EVICTION_POLICIES)}, got {self.radix_eviction_policy!r}")
        if self.radix_eviction_policy == "priority" and not self.enable_priority_scheduling:
            raise ValueError("--radix-eviction-policy priority requires --enable-priority-scheduling (without it every request is as important)")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError(f"--priority-scheduling-preemption-threshold must be >= 0, got {self.priority_scheduling_preemption_threshold}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if self.enable_return_hidden_states and self.is_embedding:
            # (SGLang accepts the pair and the flag does nothing: an embedding request has no such field)
            raise ValueError(
                "--enable-return-hidden-states is for generation requests, which an embedding server (--is-embedding) "
                "does not run; its embeddings already are the final-norm hidden state (of the last prompt token, "
                "L2-normalised). Drop one of the two flags."
            )
        self._check_speculative()
        self._check_lora()
        if self.grammar_backend not in GRAMMAR_BACKENDS:  # (SGLang's outlines / llguidance are not built)
            raise ValueError(f"--grammar-backend must be one of {', '.join(GRAMMAR_BACKENDS)}, got {self.grammar_backend!r}")
        # Settings under which no request could ever be scheduled: refuse them, not hang.
        if self.chunked_prefill_size is not None and 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError(
                f"--chunked-prefill-size ({self.chunked_prefill_size}) must be at least --page-size ({self.page_size}): "
                "a chunk holds whole pages (or -1 to disable chunking)"
            )
        if self.cuda_graph_max_bs is not None and (isinstance(self.cuda_graph_max_bs, bool) or not isinstance(self.cuda_graph_max_bs, int)):
            raise ValueError(f"--cuda-graph-max-bs must be an integer >= 1, got {self.cuda_graph_max_bs!r}")
        for name in ("prefill_max_requests", "max_running_requests", "context_length", "max_queued_requests", "cuda_graph_max_bs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {value}")
        for name in ("max_prefill_tokens", "decode_log_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("schedule_conservativeness", "cpu_kv_cache_gb", "watchdog_timeout", "soft_watchdog_timeout"):
            value = getattr(self, name)
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"--{_flag(name)} must be a number > 0, got {value}")
        if not -(2**63) <= self.random_seed < 2**64:  # what torch.manual_seed takes
            raise ValueError(f"--random-seed must be in [-2**63, 2**64), got {self.random_seed}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535] (0 picks a free one), got {self.port}")
        if not isinstance(logging.getLevelName(self.log_level.upper()), int):  # what configure_logging reads
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")

    def _check_lora(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {self.max_loras_per_batch}")
        if not self.enable_lora and self.lora_paths is None:
            shaping = ("max_loras_per_batch", "max_lora_rank", "lora_target_modules", "max_loaded_loras")
            changed = [f"--{_flag(f.name)}" for f in fields(self) if f.name in shaping and getattr(self, f.name) != f.default]
            if changed:  # (not silently ignored)
                raise ValueError(f"{', '.join(changed)} set without --lora-paths or --enable-lora: name the adapters (or turn LoRA on), or drop it")
            if self.lora_adapters is not None:
                raise ValueError("lora_adapters is filled from lora_paths by resolve_server_args: give lora_paths instead")
            return
        if self.tp_size > 1:
            raise ValueError(
                f"LoRA (--lora-paths, --enable-lora) needs --tp-size 1: minisgl's LoRA adds each adapter's delta to the "
                f"whole q/k/v/o and gate/up/down outputs, and with --tp-size {self.tp_size} each rank holds only a slice "
                "of them (tensor parallelism does not shard the adapters); drop LoRA or use --tp-size 1"
            )
        if self.speculative_algorithm is not None:
            raise ValueError(
                "LoRA (--lora-paths, --enable-lora) does not combine with --speculative-algorithm: a verify pass would "
                "have to apply each request's adapter too, which it does not. Drop one of the two."
            )
        if self.is_embedding:
            raise ValueError("LoRA (--lora-paths, --enable-lora) serves generation adapters; an embedding server (--is-embedding) does not apply them: drop one of the two")
        self._check_lora_shapes()
        if self.lora_paths is None:
            if self.max_lora_rank is None or self.lora_target_modules is None:  # (SGLang's rule)
                raise ValueError(
                    "--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules: the largest "
                    "rank and the modules of the adapters /load_lora_adapter may load"
                )
            if self.lora_adapters is not None:
                raise ValueError("lora_adapters is filled from lora_paths by resolve_server_args: give lora_paths instead")
            return
        if not isinstance(self.lora_paths, tuple) or not all(isinstance(e, str) for e in self.lora_paths):
            # frozen: a list would make the args unhashable and mutable; a str would be read letter by letter
            raise ValueError(
                f"lora_paths must be a list (or tuple) of NAME=PATH strings, e.g. ['a=/path/to/a'], got {self.lora_paths!r}"
            )
        if not self.lora_paths:
            raise ValueError("--lora-paths is empty: name at least one adapter, or leave it out")
        adapters = parse_lora_paths(self.lora_paths)  # (duplicate names, missing directories)
        if self.lora_adapters is not None and self.lora_adapters != adapters:
            raise ValueError("lora_adapters is filled from lora_paths by resolve_server_args: give lora_paths only")
        if self.max_loaded_loras is not None and len(adapters) > self.max_loaded_loras:
            raise ValueError(f"--lora-paths names {len(adapters)} adapters, more than --max-loaded-loras {self.max_loaded_loras}")

    def _check_lora_shapes(self) -> None:
        """--max-lora-rank, --lora-target-modules and --max-loaded-loras: what adapters loaded later may be."""
        for name in ("max_lora_rank", "max_loaded_loras"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{_flag(name)} must be an integer >= 1, got {value!r}")
        targets = self.lora_target_modules
        if targets is None:
            return
        if not isinstance(targets, tuple) or not targets or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"lora_target_modules must be a list of module names, e.g. ['q_proj', 'v_proj'] or ['all'], got {targets!r}")
        if "all" in targets and len(targets) > 1:
            raise ValueError("--lora-target-modules all stands alone: give `all` or a list of module names, not both")
        bad = [t for t in targets if t != "all" and t not in SUPPORTED_TARGET_MODULES]
        if bad:
            raise ValueError(f"--lora-target-modules {bad}: LoRA applies to {', '.join(SUPPORTED_TARGET_MODULES)} (or all of them: all)")

    def _check_speculative(self) -> None:
        if self.speculative_algorithm is None:
            changed = [f"--{_flag(f.name)}" for f in fields(self) if f.name.startswith("speculative_") and getattr(self, f.name) != f.default]
            if changed:  # (not silently ignored)
                raise ValueError(f"{', '.join(changed)} set without --speculative-algorithm: add --speculative-algorithm NGRAM, or drop it")
            return
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:  # (SGLang's EAGLE / MTP / STANDALONE need a draft model: not built)
            raise ValueError(f"--speculative-algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)}, got {self.speculative_algorithm!r}")
        if not 2 <= self.speculative_num_draft_tokens <= 64:
            raise ValueError(
                "--speculative-num-draft-tokens must be in [2, 64] (it counts the last sampled token too; each one is a "
                f"row of logits per request in a verify pass), got {self.speculative_num_draft_tokens}"
            )
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not 1 <= low <= high:
            raise ValueError(
                "--speculative-ngram-min-match-window-size and --speculative-ngram-max-match-window-size must satisfy "
                f"1 <= min <= max, got {low} and {high}"
            )
        if self.is_embedding:
            raise ValueError("--speculative-algorithm speeds up decoding, which an embedding server (--is-embedding) never runs: drop one of the two flags")
        if self.enable_mixed_chunk:  # (SGLang turns mixed chunks off under speculative decoding)
            raise ValueError(
                "--enable-mixed-chunk does not combine with --speculative-algorithm: a verify pass checks the running "
                "requests' drafts, and a prefill chunk cannot ride in it. Drop one of the two flags."
            )

    @property
    def is_resolved(self) -> bool:
        return (
            self.device != "auto" and self.dtype != "auto" and self.attention_backend != "auto"
            and self.kv_cache_dtype != "auto" and self.model_path is not None
            and (self.lora_paths is None or (self.lora_adapters is not None and self.enable_lora))
            and self.lora_target_modules != ("all",)
        )  # fmt: skip

    # ------------------------------------------------------------------ argparse
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one flag per field, named after the field (`--page-size`), plus its aliases."""
        for f in fields(ServerArgs):
            meta = f.metadata
            if meta.get("resolved"):  # (filled by resolve_server_args, not given)
                continue
            names = ["--" + f.name.replace("_", "-"), *meta.get("flags", ())]
            kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta.get("help", "")}
            if f.type in ("bool", bool):
                kwargs["action"] = argparse.BooleanOptionalAction
            elif "nargs" in meta:  # a tuple of strings (--lora-paths A=x B=y)
                kwargs["nargs"] = meta["nargs"]
            else:
                kwargs["type"] = _field_parser(f.type)
                if "choices" in meta:
                    kwargs["choices"] = meta["choices"]
            parser.add_argument(*names, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        for f in fields(cls):  # argparse's nargs lists -> the frozen tuples the fields hold
            if "nargs" in f.metadata and isinstance(values.get(f.name), list):
                values[f.name] = tuple(values[f.name])
        return cls(**values)

    @classmethod
    def from_argv(cls, argv: Sequence[str]) -> "ServerArgs":
        parser = argparse.ArgumentParser()
        cls.add_cli_args(parser)
        return cls.from_cli_args(parser.parse_args(list(argv)))


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _field_parser(type_name: Any):
    """Map a field's (string) annotation to an argparse `type`."""
    name = str(type_name)
    if "Literal" in name or "str" in name:
        return str
    if "int" in name:
        return int
    if "float" in name:
        return float
    return str


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _auto_cpu_backend(dtype: str) -> str:
    """The C decode kernel when it builds here (float32 only), else the plain torch backend."""
    if dtype != "float32":
        return "torch"
    from minisgl.kernels.cpu_build import CpuKernelUnavailable, load_all_cpu_kernels

    try:
        load_all_cpu_kernels()  # compiled once per machine, then cached
    except CpuKernelUnavailable as e:
        logger.warning("attention backend: torch, because the CPU kernel is unavailable: %s", e)
        return "torch"
    return "cpu"


def _resolve_kv_cache_dtype(kv_dtype: str, dtype: str, backend: str) -> str:
    """auto -> the model's dtype; bf16 -> bfloat16; a pool narrower than the model only where it is read right."""
    kv_dtype = {"auto": dtype, "bf16": "bfloat16"}.get(kv_dtype, kv_dtype)
    if kv_dtype == dtype:
        return kv_dtype
    if (dtype, kv_dtype) != ("float32", "bfloat16"):
        raise ValueError(f"--kv-cache-dtype {kv_dtype} under a {dtype} model is not supported; use auto")
    if backend not in ("cpu", "torch"):
        raise ValueError(
            f"--kv-cache-dtype bfloat16 under a float32 model runs with --attention-backend cpu or torch, "
            f"not {backend} (its kernels read the pool in the model's dtype); use --kv-cache-dtype auto"
        )
    return kv_dtype


def resolve_server_args(args: ServerArgs) -> ServerArgs:
    """Fill every "auto" once and return a new, fully resolved ServerArgs.

    Values that need the model config (context length, KV pool size) are resolved by
    the ModelRunner, which owns the model; they stay None here.
    """
    device = _resolve_device(args.device)
    if device == "cuda" and args.tp_size > _cuda_device_count():  # (rank r runs on cuda:r)
        raise ValueError(
            f"--tp-size {args.tp_size} runs one rank per GPU, and torch sees {_cuda_device_count()} "
            "(CUDA_VISIBLE_DEVICES chooses them): use a --tp-size no larger than that"
        )
    dtype = _resolve_dtype(args.dtype, device)
    backend = _resolve_attention_backend(args.attention_backend, device, dtype)
    kv_dtype = _resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, backend)
    chunk = args.chunked_prefill_size
    if chunk is None:
        chunk = 8192 if device == "cuda" else 2048
    # accepted, and unused in this setting: said at start, not silently dropped (SGLang is silent)
    if args.enable_mixed_chunk and chunk <= 0:
        logger.warning(
            "--enable-mixed-chunk lets decoding requests ride in the chunks of a chunked prefill; with "
            "--chunked-prefill-size %d (no chunking) it has no effect", chunk
        )
    if device == "cpu" and args.mem_fraction_static is not None:
        logger.warning("--mem-fraction-static sizes the KV pool on CUDA only; on CPU use --cpu-kv-cache-gb or --max-total-tokens")
    if device == "cpu" and args.max_total_tokens is not None and args.cpu_kv_cache_gb != _DEFAULT_CPU_KV_CACHE_GB:
        logger.warning("--cpu-kv-cache-gb is not used: --max-total-tokens %d sets the KV pool", args.max_total_tokens)
    mem_fraction = args.mem_fraction_static if args.mem_fraction_static is not None else 0.85
    model_path = args.model_path or BUILTIN_MODEL_DIR
    if is_missing_local_dir(model_path):  # refused here, before any process starts
        raise ValueError(f"Model directory {model_path!r} does not exist")
    if args.tokenizer_path is not None and is_missing_local_dir(args.tokenizer_path):
        raise ValueError(f"Tokenizer directory {args.tokenizer_path!r} does not exist")
    return dataclasses.replace(
        args,
        device=device,
        dtype=dtype,
        attention_backend=backend,
        kv_cache_dtype=kv_dtype,
        chunked_prefill_size=chunk,
        mem_fraction_static=mem_fraction,
        model_path=model_path,
        tokenizer_path=args.tokenizer_path or model_path,
        served_model_name=args.served_model_name or ("minisgl-builtin" if args.model_path is None else model_path),
        lora_adapters=parse_lora_paths(args.lora_paths) if args.lora_paths else None,  # (parsed once, here)
        dist_timeout=args.dist_timeout if args.dist_timeout is not None else DEFAULT_DIST_TIMEOUT_S,
        enable_lora=args.enable_lora or bool(args.lora_paths),  # (SGLang: --lora-paths turns LoRA on)
        # `all`: every module LoRA applies to; None stays None (the LoRAManager infers it from --lora-paths)
        lora_target_modules=SUPPORTED_TARGET_MODULES if args.lora_target_modules == ("all",) else args.lora_target_modules,
    )


def _resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if _cuda_available() else "cpu"
    if device == "cuda" and not _cuda_available():
        raise ValueError("--device cuda was requested but torch sees no CUDA device; use --device cpu")
    return device


def _resolve_dtype(dtype: str, device: str) -> str:
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if device == "cpu" and dtype == "float16":
        raise ValueError("float16 is not supported on CPU (matmuls are ~100x slower); use float32 or bfloat16")
    return dtype


def _resolve_attention_backend(requested: str, device: str, dtype: str) -> str:
    """auto -> triton on CUDA, the C kernel on a CPU where it builds; a backend that cannot run here is refused."""
    backend = requested
    if backend == "auto":
        backend = "triton" if device == "cuda" else _auto_cpu_backend(dtype)
    if backend == "cpu" and (device != "cpu" or dtype != "float32"):
        raise ValueError(
            f"--attention-backend cpu runs float32 on the CPU only (got --device {device} --dtype {dtype}); "
            f"use --attention-backend {'torch' if device == 'cpu' else 'torch or triton'}"
        )
    if requested == "cpu":  # chosen by hand: refused now if its C kernels cannot be built, not after the model loaded
        from minisgl.kernels.cpu_build import CpuKernelUnavailable, load_all_cpu_kernels

        try:
            load_all_cpu_kernels()
        except CpuKernelUnavailable as e:
            raise ValueError(f"--attention-backend cpu needs minisgl's C kernels, which cannot be built here: {e}") from e
    if backend == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton compiles for GPUs; on a CPU only its interpreter runs (slowly: tests, teaching)
        raise ValueError(
            "--attention-backend triton needs a GPU (or TRITON_INTERPRET=1 set before start, to run the "
            "kernels in Triton's slow interpreter); on the CPU use --attention-backend cpu or torch"
        )
    if backend == "triton" and importlib.util.find_spec("triton") is None:  # not a dependency: ~1 GB the CPU never uses
        chosen = "--attention-backend triton" if requested == "triton" else "the triton backend (auto on CUDA)"
        raise ValueError(
            f"{chosen} needs the triton package (CUDA builds of torch on Linux bring it): "
            "pip install triton, or use --attention-backend torch"
        )
    return backend


def is_missing_local_dir(model_path: str) -> bool:
    """A path that can only mean a local directory (absolute, ./, ../, or a/b/c) and is not one.

    Anything else that is not a directory (`org/name`) is a Hugging Face hub id (loader.py).
    """
    looks_local = os.path.isabs(model_path) or model_path.startswith(".") or model_path.count("/") > 1
    return looks_local and not os.path.isdir(model_path)


def chunked_prefill_enabled(args: ServerArgs) -> bool:
    """SGLang: chunked_prefill_size <= 0 means chunking is disabled."""
    return args.chunked_prefill_size is not None and args.chunked_prefill_size > 0


@dataclass(frozen=True)
class PortArgs:
    """The ipc:// endpoints that connect the three processes (DESIGN.md, "Processes").

    Who binds and who connects:
      scheduler_input_ipc_name  Scheduler PULL binds; TokenizerManager PUSH connects.
      detokenizer_ipc_name      Detokenizer PULL binds; Scheduler PUSH connects.
      tokenizer_ipc_name        TokenizerManager PULL binds; Detokenizer PUSH and the
                                Scheduler's control PUSH (flush/load replies) connect.
      visualizer_ipc_name       Scheduler PUB binds (with --visualize); HTTP SUB connects.
      tp_store_path             --tp-size N: the file where the scheduler ranks meet (a FileStore);
                                their gloo group then talks over loopback only.
    All live in one private temp dir, so nothing but HTTP listens beyond this machine.
    """

    ipc_dir: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    tokenizer_ipc_name: str
    visualizer_ipc_name: str
    tp_store_path: str

    @classmethod
    def init_new(cls, ipc_dir: Optional[str] = None) -> "PortArgs":
        import tempfile

        import zmq

        d = ipc_dir or tempfile.mkdtemp(prefix="minisgl-")
        longest = f"{d}/scheduler_input"
        if len(longest.encode()) > zmq.IPC_PATH_MAX_LEN:  # (107 bytes on Linux, 103 on macOS)
            if ipc_dir is None:
                os.rmdir(d)
            raise ValueError(
                f"The socket path {longest!r} is longer than the {zmq.IPC_PATH_MAX_LEN} bytes a Unix socket "
                "takes: set TMPDIR to a shorter folder (e.g. TMPDIR=/tmp)"
            )
        return cls(
            ipc_dir=d,
            scheduler_input_ipc_name=f"ipc://{d}/scheduler_input",
            detokenizer_ipc_name=f"ipc://{d}/detokenizer",
            tokenizer_ipc_name=f"ipc://{d}/tokenizer",
            visualizer_ipc_name=f"ipc://{d}/visualizer",
            tp_store_path=f"{d}/tp-store",
        )
