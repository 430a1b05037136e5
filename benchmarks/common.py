"""Shared pieces of the benchmarks: the model they build, the machine they run on, the
matmul rate that sets the FLOPs floor, percentiles, and how results are printed.

Where it sits: every `benchmarks/bench_*.py` script imports this module. In: flags.
Out: a model directory with random weights (built once, reused by path), a description
of the machine, and `RESULT name value unit` lines that tests/test_benchmarks.py and
docs/benchmarks.md read. Owns nothing at run time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Sequence

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Let `python benchmarks/bench_x.py` import minisgl from a source checkout.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

DEFAULT_MODEL_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "minisgl", "bench-models")


@dataclass(frozen=True)
class ModelShape:
    """A Qwen3-shaped decoder. The defaults are the ~30M-parameter offline model of issue 8."""

    hidden: int = 512
    layers: int = 8
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 64
    inter: int = 2048
    vocab: int = 4096
    max_pos: int = 8192

    @property
    def name(self) -> str:
        return f"qwen3-h{self.hidden}-l{self.layers}-a{self.heads}-kv{self.kv_heads}-d{self.head_dim}-i{self.inter}-v{self.vocab}-p{self.max_pos}"

    def linear_shapes(self) -> List[tuple[int, int]]:
        """(in_features, out_features) of every matmul one token goes through (lm_head included)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = [(self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * self.inter), (self.inter, self.hidden)]
        return layer * self.layers + [(self.hidden, self.vocab)]

    def matmul_params(self) -> int:
        """Weights a token multiplies by: all layer matmuls + lm_head (the embedding is a lookup)."""
        return sum(i * o for i, o in self.linear_shapes())

    def workload_flops(self, input_tokens: int, output_tokens: int, num_requests: int) -> float:
        """Matmul FLOPs a generation workload cannot avoid: every prompt token and every output
        token but each request's last goes through the layers (the last is sampled, never fed),
        and only the positions that are sampled go through lm_head (one per output token)."""
        head = self.hidden * self.vocab
        fed = input_tokens + output_tokens - num_requests
        return 2.0 * ((self.matmul_params() - head) * fed + head * output_tokens)


def add_model_args(parser: argparse.ArgumentParser, shape: ModelShape = ModelShape()) -> None:
    """Flags to scale the built model (issue 8: every script accepts flags to scale up)."""
    g = parser.add_argument_group("model (random weights, built by the script)")
    g.add_argument("--model", default=None, help="Use this model directory instead of building one.")
    g.add_argument("--model-cache", default=DEFAULT_MODEL_CACHE, help="Where built models are kept.")
    for f, v in asdict(shape).items():
        g.add_argument(f"--{f.replace('_', '-')}", dest=f"shape_{f}", type=int, default=v)


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    """Device, dtype and CPU threads; the same for minisgl and its baseline in one run."""
    g = parser.add_argument_group("runtime")
    g.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op threads (default: torch's). On a CPU shared with other jobs, 1 avoids "
        "OpenMP barrier stalls that make small matmuls 10-20x slower.",
    )  # fmt: skip


def apply_runtime_args(args: argparse.Namespace) -> None:
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)


def shape_from_args(args: argparse.Namespace) -> ModelShape:
    return ModelShape(**{f: getattr(args, f"shape_{f}") for f in asdict(ModelShape())})


def build_model(shape: ModelShape, cache_dir: str = DEFAULT_MODEL_CACHE) -> str:
    """Write (once) a float32 Qwen3 model with random weights and the test tokenizer."""
    from minisgl.test_utils import make_tiny_model

    path = os.path.join(cache_dir, shape.name)
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    tmp = f"{path}.tmp{os.getpid()}"
    make_tiny_model(
        tmp, "qwen3", vocab_size=shape.vocab, seed=0, dtype="float32", init_std=0.02,
        hidden_size=shape.hidden, num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, intermediate_size=shape.inter,
        max_position_embeddings=shape.max_pos,
    )  # fmt: skip
    os.replace(tmp, path)  # atomic: a concurrent run never sees a half-written model
    return path


def model_from_args(args: argparse.Namespace, flops_floor: bool = True) -> tuple[str, ModelShape]:
    """The model to benchmark and its shape. `flops_floor`: the script computes a FLOPs floor or a
    matmul rate from the shape, which a mixture-of-experts --model cannot give (refused)."""
    shape = shape_from_args(args)
    if args.model:
        return args.model, shape_from_config(args.model, flops_floor)
    return build_model(shape, args.model_cache), shape


def moe_experts(config: Dict[str, Any]) -> int:
    """The experts a mixture-of-experts config routes over, as minisgl reads it (0: dense; a MoE
    architecture whose config leaves the count to its class default counts too)."""
    from minisgl.models.registry import get_arch_spec

    _, spec = get_arch_spec(config)
    moe = spec.moe(config) if spec.moe is not None else None
    return moe.num_experts if moe is not None and moe.sparse_layers else 0


def shape_from_config(path: str, flops_floor: bool = True) -> ModelShape:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    experts = moe_experts(c)
    if experts and flops_floor:  # a token multiplies only its top-k experts' weights: intermediate_size says nothing of that
        raise ValueError(
            f"--model {path} is a mixture-of-experts model ({experts} experts): this script's FLOPs floor and "
            "matmul-rate probe model a dense decoder and would report wrong numbers; benchmark a dense model "
            "(bench_serving, bench_prefix_cache, bench_chunked_prefill and bench_scheduler_overhead take a MoE model)"
        )
    return ModelShape(
        hidden=c["hidden_size"], layers=c["num_hidden_layers"], heads=c["num_attention_heads"],
        kv_heads=c.get("num_key_value_heads", c["num_attention_heads"]),
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        inter=c.get("intermediate_size", 0), vocab=c["vocab_size"], max_pos=c["max_position_embeddings"],
    )  # fmt: skip


def params_label(model_path: str, shape: ModelShape) -> Any:
    """The config line's "params": the dense matmul weights, or n/a for a mixture-of-experts model."""
    config = os.path.join(model_path, "config.json")
    if os.path.exists(config):
        with open(config) as f:
            if moe_experts(json.load(f)):
                return "n/a (mixture of experts)"
    return shape.matmul_params()


# ---------------------------------------------------------------------- machine
def machine_info() -> Dict[str, Any]:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    info: Dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def print_header(title: str, workload: Dict[str, Any], config: Dict[str, Any]) -> None:
    """Every script opens by saying what it measures, on what, and where (STYLE.md habit 14)."""
    print(f"=== {title} ===")
    print("machine:  " + json.dumps(machine_info()))
    print("workload: " + json.dumps(workload))
    print("config:   " + json.dumps(config))
    sys.stdout.flush()


def print_result(name: str, value: float, unit: str = "", note: str = "") -> None:
    """One machine-readable line per number: `RESULT <name> <value> <unit> [# note]`."""
    line = f"RESULT {name} {value:.4g} {unit}".rstrip()
    print(line + (f"  # {note}" if note else ""), flush=True)


# ---------------------------------------------------------------------- numbers
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]; nan when empty."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def print_latency(name: str, values_s: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> Dict[str, float]:
    """Print p50/p90/p99 (and mean) of a list of seconds, in ms; return them."""
    xs = list(values_s)
    out = {f"p{int(q)}": percentile(xs, q) * 1e3 for q in qs}
    out["mean"] = statistics.fmean(xs) * 1e3 if xs else float("nan")
    for k, v in out.items():
        print_result(f"{name}_{k}", v, "ms")
    return out


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("inf")


# ---------------------------------------------------------------------- FLOPs floor
def matmul_rate(
    shape: ModelShape,
    num_tokens: int,
    dtype: str = "float32",
    device: str = "cpu",
    repeat: int = 3,
    every_layer: bool = False,
) -> float:
    """FLOP/s of the model's own matmuls at `num_tokens` rows (the best of `repeat` passes).

    This is the rate the FLOPs floor uses: the same shapes the forward multiplies, on the
    same threads, measured in the same run as the engine. On the CPU in float32 it is the
    faster of torch's F.linear and the oneDNN-packed weights minisgl multiplies by
    (minisgl/layers/linear.py), so the floor is what this machine's best matmul allows.

    By default one weight per distinct shape is multiplied again for every layer: ~15 MB
    for the 30M model, which stays in the CPU's cache, so this is the rate with the weights
    already on chip. `every_layer=True` gives each layer its own weights, as the model has
    (134 MB at the defaults): every pass then streams them from memory, as a real forward
    must. The targets use the first (the stricter floor); the second is printed beside it.
    """
    import torch

    from minisgl.layers.linear import linear, pack_weight_for_cpu

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    x = {i: torch.randn(num_tokens, i, generator=gen).to(device=device, dtype=dt) for i, _ in set(shape.linear_shapes())}
    # key of each matmul's weight: its position (every_layer) or just its shape (shared)
    keys = list(enumerate(shape.linear_shapes())) if every_layer else [(0, s) for s in shape.linear_shapes()]
    ws = {k: torch.randn(k[1][1], k[1][0], generator=gen).to(device=device, dtype=dt) * 0.02 for k in set(keys)}
    packs = {k: pack_weight_for_cpu(w) for k, w in ws.items()}
    variants = [{k: None for k in ws}] + ([packs] if all(p is not None for p in packs.values()) else [])
    flops = 2.0 * num_tokens * shape.matmul_params()
    best = float("inf")
    with torch.inference_mode():
        for packed in variants:
            for _ in range(repeat + 1):  # the first pass warms up allocator and kernels
                _sync(device)
                t0 = time.perf_counter()
                for k in keys:
                    linear(x[k[1][0]], ws[k], packed=packed[k])  # [num_tokens, out]
                _sync(device)
                best = min(best, time.perf_counter() - t0)
    return flops / best


def copy_bandwidth(device: str = "cuda", nbytes: int = 1 << 28) -> float:
    """Device copy bandwidth in bytes/s, read + write counted (the GB/s ceiling of decode)."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(4):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_requests(n: int, input_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0
                    ) -> tuple[List[List[int]], List[int]]:  # fmt: skip
    """nano-vllm's protocol: lengths uniform in [lo, hi], random token ids, seeded."""
    import random

    rng = random.Random(seed)
    # ids from 3: skip the special tokens (<|endoftext|>, <|im_start|>, <|im_end|>)
    input_ids = [[rng.randint(3, vocab - 1) for _ in range(rng.randint(*input_range))] for _ in range(n)]
    output_lens = [rng.randint(*output_range) for _ in range(n)]
    return input_ids, output_lens


def text_prompts(tokenizer: Any, input_ids: List[List[int]], rounds: int = 4) -> tuple[List[str], int]:
    """Texts for an HTTP benchmark that tokenize back to len(ids) tokens each; and their total tokens.

    Random ids decoded to text do not encode back to the same ids: byte-level pieces merge,
    and this workload's 10,669 ids came back as 12,123 tokens, 14% more prefill than the
    workload line says. Re-encoding and cutting to the target length converges in one round
    for almost every prompt; the few that never settle are off by a token or two, which the
    returned total (what the servers really prefill) shows.
    """
    texts: List[str] = []
    total = 0
    for ids in input_ids:
        cur = list(ids)
        for _ in range(rounds):
            text = tokenizer.decode(cur)
            encoded = tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) == len(ids):
                break
            # too long: keep the first len(ids) tokens; too short: top up from the original ids
            cur = encoded[: len(ids)] if len(encoded) > len(ids) else encoded + ids[len(encoded) :]
        texts.append(text)
        total += len(encoded)
    return texts, total
