#!/usr/bin/env bash
# One GPU check for the CUDA path (issue 6), meant for a CUDA machine that has python3
# with torch + triton + transformers and nothing of this project but the checkout:
#   1. install the project (editable, no deps, no network),
#   2. kernel tests on CUDA (tests/test_kernels.py: the same tests as on CPU, device cuda),
#   3. the engine with the triton backend against the torch backend (tests/test_triton_backend.py;
#      speculative decoding's verify passes through the triton extend kernel too), and decode steps
#      replayed from CUDA graphs against eager ones (tests/test_cuda_graph.py),
#   4. the transformers parity tests (tests/test_model_parity.py: on the CPU, except the triton
#      layer hooks, which run on the GPU here), and structured output's vocab mask on the GPU
#      (tests/test_structured_output.py -k apply_vocab_mask; skipped without xgrammar),
#   5. each kernel's benchmark (benchmarks/bench_kernels.py: GB/s, vs torch, vs device copy),
#   6. the offline throughput benchmark (benchmarks/bench_offline.py), with CUDA graphs and without,
#      and against transformers on the same GPU (--compare hf),
#   7. the server on the GPU under 32 streaming clients (benchmarks/bench_serving.py --backend minisgl),
#   8. NGRAM speculative decoding against plain decoding (benchmarks/bench_speculative.py, two workloads).
# Each step has its own time limit (480 s in all, 5 s more each to kill one; steps 1-6 took 2
# minutes on an H200) so it ends in under 8 minutes; a step that fails does not stop the others. The summary table is
# printed last.
#   usage: bash benchmarks/gpu_check.sh [LOG_DIR]     (LOG_DIR defaults to a temp dir)
set -u
cd "$(dirname "$0")/.."
LOG_DIR="${1:-$(mktemp -d)}"
mkdir -p "$LOG_DIR"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET  # the kernels must compile for the GPU here
SUMMARY=()

# pyproject's addopts name plugins (nbval, pytest-timeout) a GPU image may lack: pytest would
# stop at "unrecognized arguments" before running a test. Each step has its own time limit.
PYTEST=("$PY" -m pytest -o "addopts=" -p no:cacheprovider -q -rs)

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to LOG_DIR/NAME.log, record rc and seconds
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS rc
    echo "=== $name (limit ${limit}s): $*"
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$LOG_DIR/$name.log" | tail -n 25
    rc=${PIPESTATUS[0]}
    local status="ok"; [ "$rc" -ne 0 ] && status="FAIL rc=$rc"; [ "$rc" -eq 124 ] && status="TIMEOUT"
    SUMMARY+=("$(printf '%-16s %-12s %5ss  %s' "$name" "$status" "$((SECONDS - t0))" "$(grep -E 'passed|failed|error' "$LOG_DIR/$name.log" | tail -n 1 | cut -c1-70)")")
}

"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 1
step install 20 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e .
step kernels 60 "${PYTEST[@]}" tests/test_kernels.py
step triton_engine 80 "${PYTEST[@]}" tests/test_triton_backend.py tests/test_cuda_graph.py
step parity 45 "${PYTEST[@]}" tests/test_model_parity.py
# structured output's vocab mask on the GPU (skipped where xgrammar is not installed)
step grammar_mask 20 "${PYTEST[@]}" tests/test_structured_output.py -k apply_vocab_mask
step bench_kernels 35 "$PY" benchmarks/bench_kernels.py
step bench_offline 40 "$PY" benchmarks/bench_offline.py --device cuda --dtype bfloat16
step bench_offline_eager 40 "$PY" benchmarks/bench_offline.py --device cuda --dtype bfloat16 --disable-cuda-graph
step bench_vs_hf 50 "$PY" benchmarks/bench_offline.py --device cuda --dtype bfloat16 --compare hf
step bench_serving 50 "$PY" benchmarks/bench_serving.py --device cuda --dtype bfloat16 --backend minisgl --log-dir "$LOG_DIR"
step bench_speculative 40 "$PY" benchmarks/bench_speculative.py --device cuda --dtype bfloat16 --workloads loop quote --batch-sizes 1 8 --num-draft-tokens 4 --repeats 1

echo
echo "=== kernel benchmark table"
grep -A 20 '^kernel ' "$LOG_DIR/bench_kernels.log" 2>/dev/null || echo "(no table: see $LOG_DIR/bench_kernels.log)"
echo
echo "=== throughput (bench_offline with graphs / eager, against transformers; the server under 32 clients)"
for name in bench_offline bench_offline_eager bench_vs_hf bench_serving bench_speculative; do
    grep -h -E '^RESULT (minisgl_output_tok_s|decode_step_ms|decode_step_vs_floor |decode_graph_replays|hf_static_output_tok_s|hf_cb_output_tok_s|minisgl_vs_best_hf|minisgl_ttft_p50|minisgl_itl_p50|[a-z]+_bs[0-9]+_ngram4_vs_off)' \
        "$LOG_DIR/$name.log" 2>/dev/null | sed "s/^RESULT /$name: /"
done
echo
echo "=== summary (logs in $LOG_DIR)"
printf '%s\n' "${SUMMARY[@]}"
