"""The CPU kernels (kernels/*_cpu.py: decode attention, fused add + RMSNorm, RoPE) against their
torch references, and the `cpu` attention backend against the torch backend through the engine.

The kernels are C built with the system compiler (kernels/cpu_build.py); these tests build
them once into a temporary cache directory, so they also check that a fresh machine can.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
from kernel_helpers import cpu_kernels_unavailable, kv_buffers, paged_req_to_token

from minisgl import Engine
from minisgl.kernels import cpu_build
from minisgl.kernels.decode_attention import decode_attention_ref
from minisgl.kernels.decode_attention_cpu import decode_attention_cpu
from minisgl.kernels.fused_add_rmsnorm import fused_add_rmsnorm_ref
from minisgl.kernels.fused_add_rmsnorm_cpu import fused_add_rmsnorm_cpu
from minisgl.kernels.rotary_embedding import rotary_embedding_ref
from minisgl.kernels.rotary_embedding_cpu import rotary_embedding_cpu
from minisgl.kernels.silu_and_mul_cpu import silu_and_mul_cpu, silu_and_mul_ref
from minisgl.layers.attention.cpu_backend import FRESH_MIN_TOKENS, SHORT_EXTEND_ROWS, CpuAttnBackend
from minisgl.layers.attention.torch_backend import TorchNativeAttnBackend
from minisgl.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from minisgl.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from minisgl.server_args import ServerArgs, resolve_server_args

if cpu_kernels_unavailable():  # no compiler, or one that cannot build them: auto picks torch
    pytest.skip(cpu_kernels_unavailable(), allow_module_level=True)

LENS = [1, 7, 33, 129]  # irregular: one token, under a page, just over two pages, just over eight


@pytest.fixture(autouse=True, scope="module")
def fresh_kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Build into an empty cache directory once for this module (a fresh machine's first run)."""
    from minisgl.kernels import decode_attention_cpu as da, fused_add_rmsnorm_cpu as rn, rotary_embedding_cpu as rp
    from minisgl.kernels import silu_and_mul_cpu as sm

    def forget_loaded() -> None:  # earlier tests may have loaded the kernels from the default cache
        for cached in (cpu_build.load_cpu_library, da._kernel, rn._kernel, rp._kernel, sm._kernel):
            cached.cache_clear()

    mp = pytest.MonkeyPatch()
    mp.setenv("MINISGL_CACHE_DIR", str(tmp_path_factory.mktemp("minisgl-cache")))
    forget_loaded()
    yield
    mp.undo()
    forget_loaded()


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_decode_kernel_matches_reference(page_size: int, Hq: int, Hkv: int, head_dim: int, num_threads: int) -> None:
    r2t, rows, S = paged_req_to_token(LENS, page_size, "cpu")
    k_buf, v_buf = kv_buffers(S, Hkv, head_dim, torch.float32, "cpu")
    seq_lens = torch.tensor(LENS)
    # q as a strided view (every other row of a wider tensor), as the qkv projection hands it over
    q = torch.randn(2 * len(LENS), Hq, head_dim)[::2]
    scaling = head_dim**-0.5
    k_before, v_before = k_buf.clone(), v_buf.clone()
    out = decode_attention_cpu(q, k_buf, v_buf, r2t, rows, seq_lens, scaling, num_threads=num_threads)
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rows, seq_lens, scaling)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(k_buf, k_before) and torch.equal(v_buf, v_before)  # the pool (and slot 0) is only read


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("lens", [LENS, [1500, 1]], ids=["batch", "split"])
def test_decode_kernel_reads_a_bfloat16_pool(page_size: int, head_dim: int, lens: List[int]) -> None:
    """--kv-cache-dtype bfloat16: the kernel widens each K/V element and matches the reference on the widened pool."""
    r2t, rows, S = paged_req_to_token(lens, page_size, "cpu")
    k_buf, v_buf = (b.bfloat16() for b in kv_buffers(S, 2, head_dim, torch.float32, "cpu"))
    q, seq_lens = torch.randn(len(lens), 8, head_dim), torch.tensor(lens)
    out = decode_attention_cpu(q, k_buf, v_buf, r2t, rows, seq_lens, head_dim**-0.5)
    ref = decode_attention_ref(q, k_buf.float(), v_buf.float(), r2t, rows, seq_lens, head_dim**-0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("lens", [[3000], [1500, 1], [700, 900, 5]], ids=["one-long", "long-and-short", "three"])
def test_decode_kernel_splits_long_requests(lens: List[int]) -> None:
    """Few requests: each is cut into KV chunks merged by max/exp-sum; the result must not change."""
    r2t, rows, S = paged_req_to_token(lens, 16, "cpu")
    k_buf, v_buf = kv_buffers(S, 2, 64, torch.float32, "cpu")
    q = torch.randn(len(lens), 8, 64) * 4  # peaky softmax: a wrong merge weight shows
    seq_lens = torch.tensor(lens)
    ref = decode_attention_ref(q, k_buf, v_buf, r2t, rows, seq_lens, 0.125)
    for threads in (1, 2, 4):
        out = decode_attention_cpu(q, k_buf, v_buf, r2t, rows, seq_lens, 0.125, num_threads=threads)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


def test_decode_kernel_rejects_bad_arguments() -> None:
    r2t, rows, S = paged_req_to_token([5, 9], 1, "cpu")
    k_buf, v_buf = kv_buffers(S, 2, 64, torch.float32, "cpu")
    q, seq = torch.randn(2, 4, 64), torch.tensor([5, 9])
    with pytest.raises(ValueError, match="dtype"):
        decode_attention_cpu(q.bfloat16(), k_buf, v_buf, r2t, rows, seq, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention_cpu(q, k_buf.transpose(0, 1).contiguous().transpose(0, 1), v_buf, r2t, rows, seq, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_cpu(torch.randn(2, 3, 64), k_buf, v_buf, r2t, rows, seq, 1.0)
    with pytest.raises(ValueError, match="seq_lens"):
        decode_attention_cpu(q, k_buf, v_buf, r2t, rows, torch.tensor([5, r2t.shape[1] + 1]), 1.0)
    with pytest.raises(ValueError, match="req_pool_indices"):
        decode_attention_cpu(q, k_buf, v_buf, r2t, torch.tensor([0, r2t.shape[0]]), seq, 1.0)
    with pytest.raises(ValueError, match="int64"):
        decode_attention_cpu(q, k_buf, v_buf, r2t.int(), rows, seq, 1.0)
    with pytest.raises(ValueError, match="v_buffer has dtype"):  # K and V must share the pool's dtype
        decode_attention_cpu(q, k_buf.bfloat16(), v_buf, r2t, rows, seq, 1.0)
    with pytest.raises(ValueError, match="k_buffer has dtype"):
        decode_attention_cpu(q, k_buf.half(), v_buf.half(), r2t, rows, seq, 1.0)


@pytest.mark.parametrize("N", [1, 7, 33, 129, 3000])  # 3000 x 512 takes the multi-threaded path
@pytest.mark.parametrize("H", [64, 512])
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_add_rmsnorm_matches_reference(N: int, H: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(N + H)
    x = torch.randn(N, 2 * H, generator=g)[:, :H]  # strided rows, as a slice of a wider tensor
    residual = torch.randn(N, H, generator=g) if with_residual else None
    weight = torch.randn(H, generator=g)
    out, res_out = fused_add_rmsnorm_cpu(x, residual, weight, 1e-6)
    ref_out, ref_res = fused_add_rmsnorm_ref(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(res_out, ref_res, atol=0, rtol=0)
    if residual is None:
        assert res_out is x  # no add: the residual stream is x itself, as in the reference


@pytest.mark.parametrize("N", [1, 7, 33, 129, 2000])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding_matches_reference(N: int, Hq: int, Hkv: int, head_dim: int) -> None:
    g = torch.Generator().manual_seed(N)
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [max_pos, D]
    qkv = torch.randn(N, (Hq + 2 * Hkv) * head_dim, generator=g)
    q = qkv[:, : Hq * head_dim].view(N, Hq, head_dim)  # strided views into the qkv projection
    k = qkv[:, Hq * head_dim : (Hq + Hkv) * head_dim].view(N, Hkv, head_dim)
    v_before = qkv[:, (Hq + Hkv) * head_dim :].clone()
    positions = torch.randint(0, max_pos, (N,), generator=g)
    ref_q, ref_k = rotary_embedding_ref(q, k, positions, cache)
    rotary_embedding_cpu(q, k, positions, cache)
    torch.testing.assert_close(q, ref_q, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(k, ref_k, atol=2e-5, rtol=1e-4)
    assert torch.equal(qkv[:, (Hq + Hkv) * head_dim :], v_before)  # v, next to k, untouched


@pytest.mark.parametrize("N", [1, 7, 129, 300])  # 300 x 1024 takes the multi-threaded path
def test_silu_and_mul_matches_reference(N: int) -> None:
    g = torch.Generator().manual_seed(N)
    x = torch.randn(N, 3 * 1024, generator=g)[:, : 2 * 1024] * 8  # strided rows; gates far into both tails
    x[0, :4] = torch.tensor([-200.0, -88.0, 88.0, 0.0])  # exp under/overflow territory and zero
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_ref(x), atol=1e-5, rtol=1e-5)


def test_norm_rope_and_silu_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm_cpu(torch.randn(4, 8), torch.randn(4, 9), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="dtype"):
        fused_add_rmsnorm_cpu(torch.randn(4, 8).double(), None, torch.randn(8), 1e-6)
    q, k, cache = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="positions must lie"):
        rotary_embedding_cpu(q, k, torch.tensor([0, 5, 16]), cache)
    with pytest.raises(ValueError, match="full rotary"):
        rotary_embedding_cpu(q, k, torch.tensor([0, 1, 2]), torch.randn(16, 4))
    with pytest.raises(ValueError, match="even width"):
        silu_and_mul_cpu(torch.randn(2, 7))


def test_build_is_cached_and_reports_a_missing_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cpu_build.load_cpu_library("decode_attention_cpu")
    built = list(cpu_build.cache_dir().glob("decode_attention_cpu-*.so"))
    assert len(built) == 1  # built once into this module's cache, reused by every test above
    stamp = built[0].stat().st_mtime_ns
    cpu_build.load_cpu_library.cache_clear()  # a new process, as far as the cache knows
    cpu_build.load_cpu_library("decode_attention_cpu")
    assert list(cpu_build.cache_dir().glob("decode_attention_cpu-*.so")) == built
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt

    monkeypatch.delenv("MINISGL_CACHE_DIR")  # else $XDG_CACHE_HOME/minisgl, as pip and torch do
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_build.cache_dir() == tmp_path / "xdg" / "minisgl" / "kernels"

    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(a_file / "cache"))  # cannot be created, even by root
    cpu_build.load_cpu_library.cache_clear()
    with pytest.raises(cpu_build.CpuKernelUnavailable, match="MINISGL_CACHE_DIR"):
        cpu_build.load_cpu_library("decode_attention_cpu")

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))  # nothing cached here
    monkeypatch.setenv("CC", "no-such-compiler")
    cpu_build.load_cpu_library.cache_clear()
    with pytest.raises(cpu_build.CpuKernelUnavailable, match=r"\$CC='no-such-compiler' is not a command on PATH"):
        cpu_build.load_cpu_library("decode_attention_cpu")
    cpu_build.load_cpu_library.cache_clear()
    # auto falls back to the torch backend instead of failing to start
    assert resolve_server_args(ServerArgs(device="cpu")).attention_backend == "torch"


def test_cache_key_tells_cpus_apart(tmp_path: Path) -> None:
    """A build for one CPU (-march=native) must not be loaded on another: an aarch64 block
    has no "model name", so two Arm CPUs, one with SVE and one without, were both keyed
    "aarch64" and shared a cached .so (a SIGILL on the one without)."""

    def model_of(cpuinfo: str) -> str:
        path = tmp_path / "cpuinfo"
        path.write_text(cpuinfo)
        return cpu_build._cpu_model(str(path))

    arm = "processor\t: {i}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd {extra}\nCPU implementer\t: 0x41\nCPU part\t: {part}\n\n"
    n1 = "".join(arm.format(i=i, extra="", part="0xd0c") for i in range(2))  # Neoverse N1, no SVE
    v1 = "".join(arm.format(i=i, extra="sve", part="0xd40") for i in range(2))  # Neoverse V1, SVE
    assert model_of(n1) != model_of(v1)
    assert "0xd0c" in model_of(n1) and "sve" in model_of(v1)
    x86 = "processor\t: {i}\nmodel name\t: CPU {i}\nflags\t\t: fpu avx512f\n\n"
    assert model_of(x86.format(i=0) + x86.format(i=1)) == "model name\t: CPU 0\nflags\t\t: fpu avx512f\n"  # the first block only


def test_a_damaged_cached_build_is_rebuilt(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An empty file (a crash mid-write, a bad copy) used to switch the kernels off until deleted by hand.

    Built and loaded by child processes only: truncating a library this process has mapped
    would crash it (SIGBUS) when it touches the mapping at exit."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    load = "from minisgl.kernels import cpu_build; cpu_build.load_cpu_library('silu_and_mul_cpu')"

    def load_in_a_child() -> None:
        proc = subprocess.run([sys.executable, "-c", load], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]

    load_in_a_child()
    (built,) = (tmp_path / "kernels").glob("silu_and_mul_cpu-*.so")
    assert built.stat().st_mode & 0o777 == 0o777 & ~_umask()  # readable by others (mkstemp made it 0600)
    built.write_bytes(b"")
    load_in_a_child()
    assert built.stat().st_size > 0


def test_cc_may_carry_arguments_and_a_failed_build_leaves_no_temp_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"{compiler[0]} -O2")  # as "ccache gcc": a command with arguments
    cpu_build.load_cpu_library.cache_clear()
    cpu_build.load_cpu_library("silu_and_mul_cpu")
    monkeypatch.setenv("CC", f"{compiler[0]} --no-such-flag-minisgl")
    cpu_build.load_cpu_library.cache_clear()
    with pytest.raises(cpu_build.CpuKernelUnavailable, match="building silu_and_mul_cpu.c failed"):
        cpu_build.load_cpu_library("silu_and_mul_cpu")
    assert [p.name for p in cpu_build.cache_dir().glob("tmp*")] == []
    cpu_build.load_cpu_library.cache_clear()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_auto_backend_on_cpu() -> None:
    assert resolve_server_args(ServerArgs(device="cpu")).attention_backend == "cpu"
    assert resolve_server_args(ServerArgs(device="cpu", dtype="bfloat16")).attention_backend == "torch"
    with pytest.raises(ValueError, match="float32 on the CPU only"):
        resolve_server_args(ServerArgs(device="cpu", dtype="bfloat16", attention_backend="cpu"))


@pytest.mark.parametrize("mode", [ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY])
def test_cpu_backend_extend_paths_equal_the_torch_backend(mode: ForwardMode) -> None:
    """One extend batch holding every kind of row the cpu backend routes differently: a fresh
    long prompt (causal SDPA on this pass's rows), a short fresh prompt and a long chunk on a cached
    prefix (gather + grouped SDPA), and one-token rows and short extends over a prefix (a verify
    pass's rows: the decode kernel, one query per row, causal by seq_len)."""
    torch.manual_seed(0)
    # (cached prefix, new tokens) per request
    shapes = [(0, FRESH_MIN_TOKENS + 70), (50, 20), (30, 1), (0, 5), (0, 1), (0, 2 * FRESH_MIN_TOKENS), (40, 4), (9, SHORT_EXTEND_ROWS)]
    hq, hkv, d, size = 8, 2, 64, 2048
    seq_lens = [p + n for p, n in shapes]
    slots = (torch.randperm(size - 1)[: sum(seq_lens)] + 1).tolist()  # scattered, never slot 0
    q_rows = sum(n for _, n in shapes)
    q, k, v = torch.randn(q_rows, hq, d), torch.randn(q_rows, hkv, d), torch.randn(q_rows, hkv, d)
    outs = []
    for backend in (TorchNativeAttnBackend(), CpuAttnBackend()):
        torch.manual_seed(1)  # the same cached prefix K/V for both backends
        pool = MHATokenToKVPool(size, 1, torch.float32, hkv, d, num_layers=1)
        pool.k_buffer[0].normal_()
        pool.v_buffer[0].normal_()
        r2t = ReqToTokenPool(len(shapes), 512)
        out_loc, offset = [], 0
        for i, (prefix, n) in enumerate(shapes):
            r2t.write(i, 0, torch.tensor(slots[offset : offset + prefix + n]))
            out_loc += slots[offset + prefix : offset + prefix + n]
            offset += prefix + n
        positions = torch.cat([torch.arange(p, p + n) for p, n in shapes])
        fb = ForwardBatch(
            mode, len(shapes), torch.zeros(q_rows, dtype=torch.int64), positions, torch.tensor(out_loc),
            torch.arange(len(shapes)), torch.tensor(seq_lens), seq_lens, r2t, pool, backend,
            extend_prefix_lens=torch.tensor([p for p, _ in shapes]), extend_seq_lens=torch.tensor([n for _, n in shapes]),
            extend_prefix_lens_cpu=[p for p, _ in shapes], extend_seq_lens_cpu=[n for _, n in shapes],
        )  # fmt: skip
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, 0, d**-0.5, fb))
    cpu_backend = backend
    assert len(cpu_backend.fresh) == 2 and cpu_backend.single_token is not None  # every path was taken
    assert len(cpu_backend.single_token[0]) == 1 + 1 + 4 + SHORT_EXTEND_ROWS  # (the short extends row by row)
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=1e-4)


PROMPTS = [
    "hello world, this is a test",
    "a",
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    # long enough for the fresh-prompt path (>= FRESH_MIN_TOKENS tokens)
    "Once upon a time, in a village between two rivers, there lived a clockmaker who repaired "
    "every clock in the valley except his own, which had stopped at a quarter past nine on the "
    "night his daughter left for the city, and which he wound every morning all the same.",
]


def _greedy(model_path: str, **server_args: Any) -> List[List[int]]:
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with Engine(model_path, max_total_tokens=2048, dtype="float32", **server_args) as engine:
        outs: List[Dict[str, Any]] = engine.generate(PROMPTS, params) + engine.generate(PROMPTS, params)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize(
    "server_args",
    [dict(page_size=1), dict(page_size=16), dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True),
     dict(page_size=1, kv_cache_dtype="bfloat16"), dict(page_size=16, chunked_prefill_size=16, enable_mixed_chunk=True,
                                                     kv_cache_dtype="bf16")],
    ids=["page1", "page16", "page16-chunked-mixed", "page1-bf16-kv", "page16-chunked-mixed-bf16-kv"],
)
def test_cpu_backend_matches_torch_backend_greedy(tiny_model: str, server_args: Dict[str, Any]) -> None:
    """Same greedy tokens; the second round decodes on top of radix-cache hits. With mixed
    chunks, decoding requests ride in extend batches as one-token rows (the decode kernel's
    path inside an extend) next to chunks of a longer prompt (the SDPA path)."""
    want = _greedy(tiny_model, attention_backend="torch", **server_args)
    got = _greedy(tiny_model, attention_backend="cpu", **server_args)
    assert got == want
