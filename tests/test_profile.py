"""Profiling: torch.profiler in the scheduler, started and stopped by the Engine and by a real
server's /start_profile and /stop_profile (one server start for the module).

What a user notices: a trace file appears where they asked (or in $SGLANG_TORCH_PROFILER_DIR),
it is gzip JSON that Perfetto opens, its ranges name the stages of a step, num_steps stops it
by itself after that many whole steps, every mistake is refused with a message (a 400 on the
server), and requests run on, with the same answers, while it records.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import threading
from pathlib import Path
from typing import Any, Dict, Iterator, List

import httpx
import openai
import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "def main():"]
# the ranges of a step that runs a batch (docs/scheduler.md, "Profiling a step")
STEP_RANGES = {"run_step", "get_next_batch_to_run", "run_batch", "get_forward_batch", "sample"}
# long enough that the streams still decode when the profile, sent after their first chunk, starts
STREAM_TOKENS = 128
TRACE_NAME = re.compile(r"^(?:(?P<prefix>.+)-)?\d+\.\d+-TP-0\.trace\.json\.gz$")


def load_trace(path: str) -> Dict[str, Any]:
    with gzip.open(path, "rt") as f:  # (a file that is not gzip, or not JSON, fails here)
        return json.load(f)


def range_counts(trace: Dict[str, Any]) -> Dict[str, int]:
    """How many times each named range (record_function: Perfetto's slices) occurs."""
    counts: Dict[str, int] = {}
    for event in trace["traceEvents"]:
        if event.get("cat") == "user_annotation" and event.get("ph") == "X":
            counts[event["name"]] = counts.get(event["name"], 0) + 1
    return counts


def only_trace(directory: Path) -> str:
    files = [p.name for p in directory.iterdir()]
    assert len(files) == 1 and TRACE_NAME.match(files[0]), files
    return str(directory / files[0])


# --------------------------------------------------------------------------- Engine
@pytest.fixture(scope="module")
def engine(tiny_model: str) -> Iterator[Any]:
    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", max_total_tokens=4096)
    yield eng
    eng.shutdown()


def test_engine_num_steps_stops_by_itself_after_whole_steps(engine: Any, tmp_path: Path) -> None:
    reference = engine.generate(PROMPTS, GREEDY)
    message = engine.start_profile(output_dir=str(tmp_path), num_steps=3)
    assert message.startswith("Start profiling.") and str(tmp_path) in message
    outputs = engine.generate(PROMPTS, GREEDY)  # a prefill and 5 decode steps: the profile ends inside
    assert [o["output_ids"] for o in outputs] == [r["output_ids"] for r in reference]  # profiling changes no answer
    assert not engine.scheduler.profile_in_progress
    path = only_trace(tmp_path)
    assert engine.scheduler.last_profile_paths == [path]
    trace = load_trace(path)
    counts = range_counts(trace)
    assert STEP_RANGES <= counts.keys()
    # three steps, each whole: the first one prefills, the next two decode
    assert counts["run_step"] == counts["run_batch"] == counts["sample"] == 3
    assert counts["forward_extend"] == counts["process_batch_result_prefill"] == 1
    assert counts["forward_decode"] == counts["process_batch_result_decode"] == 2
    assert counts["handle_generate_request"] == 2
    assert trace.get("with_stack") and trace.get("record_shapes")  # SGLang's defaults
    with pytest.raises(RuntimeError, match=r"Profiling is not in progress\. Call start_profile\(\) first\."):
        engine.stop_profile()


def test_engine_start_stop_writes_the_named_trace(engine: Any, tmp_path: Path) -> None:
    out_dir = tmp_path / "made" / "for" / "it"  # made when missing
    engine.start_profile(output_dir=str(out_dir), with_stack=False, record_shapes=False, profile_prefix="demo")
    with pytest.raises(RuntimeError, match=r"Profiling is already in progress\. Call stop_profile\(\) first\."):
        engine.start_profile(output_dir=str(tmp_path))
    engine.generate(PROMPTS[0], GREEDY)
    paths = engine.stop_profile()
    assert paths == [only_trace(out_dir)] and TRACE_NAME.match(os.path.basename(paths[0]))["prefix"] == "demo"
    trace = load_trace(paths[0])
    assert not trace.get("with_stack") and not trace.get("record_shapes")
    assert not any(e.get("cat") == "python_function" for e in trace["traceEvents"])  # (with_stack's events)
    counts = range_counts(trace)
    assert STEP_RANGES | {"handle_batch_token_id_out", "handle_batch_output", "self_check_during_idle"} <= counts.keys()


def test_engine_defaults_follow_sglang_environment(engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", str(tmp_path))
    monkeypatch.setenv("SGLANG_PROFILE_WITH_STACK", "false")
    engine.start_profile()
    engine.generate(PROMPTS[0], GREEDY)
    [path] = engine.stop_profile()
    assert path == only_trace(tmp_path)
    trace = load_trace(path)
    assert not trace.get("with_stack") and trace.get("record_shapes")


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"activities": ["GPU"]}, "Profiling activity 'GPU' records CUDA kernels, and this server runs on cpu"),
        ({"activities": ["CPU", "MEM"]}, "Profiling activity 'MEM' records the CUDA allocator's history"),
        ({"activities": ["cpu"]}, "Unknown profiling activity 'cpu': choose from CPU, GPU, MEM"),
        ({"activities": ["RPD"]}, "Profiling activity 'RPD' is not supported by minisgl"),
        ({"activities": []}, "activities must be a non-empty list"),
        ({"num_steps": 0}, "num_steps must be a positive integer"),
        ({"num_steps": True}, "num_steps must be a positive integer"),
        ({"with_stack": "yes"}, "with_stack must be true or false"),
        ({"profile_prefix": "a/b"}, "profile_prefix must be a non-empty file name part"),
        ({"start_step": 5}, "start_step is not supported by minisgl"),
        ({"profile_by_stage": True}, "profile_by_stage and profile_stages"),
        ({"merge_profiles": True}, "merge_profiles is not supported by minisgl"),
    ],
)
def test_engine_refuses_what_it_cannot_do(engine: Any, tmp_path: Path, kwargs: Dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=re.escape(error)):
        engine.start_profile(output_dir=str(tmp_path), **kwargs)
    assert not engine.scheduler.profile_in_progress and not list(tmp_path.iterdir())


def test_engine_output_dir_that_cannot_be_written(engine: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match=f"output_dir '{re.escape(str(blocker))}/x' cannot be written"):
        engine.start_profile(output_dir=str(blocker / "x"))
    assert not engine.scheduler.profile_in_progress


def test_a_trace_that_cannot_be_written_ends_the_profile_not_the_engine(
    engine: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:  # fmt: skip
    out_dir = tmp_path / "gone"
    engine.start_profile(output_dir=str(out_dir), with_stack=False)
    out_dir.rmdir()  # removed while it records
    out_dir.write_text("")  # (and a file in its place: even root cannot write into it)
    with pytest.raises(RuntimeError, match="Profiling stopped, but .* could not be written"):
        engine.stop_profile()
    # the same with num_steps: the step that ends the profile logs the failure and goes on
    other = tmp_path / "other"
    engine.start_profile(output_dir=str(other), num_steps=1, with_stack=False)
    other.rmdir()
    other.write_text("")
    out = engine.generate(PROMPTS[0], GREEDY)
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]
    assert "could not be written" in caplog.text
    assert not engine.scheduler.profile_in_progress
    engine.start_profile(output_dir=str(tmp_path / "again"), with_stack=False)  # and a new profile works
    assert len(engine.stop_profile()) == 1


def test_another_torch_profiler_in_the_process_is_left_alone(engine: Any, tmp_path: Path) -> None:
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as outer:
        with pytest.raises(RuntimeError, match="another torch.profiler records in this process"):
            engine.start_profile(output_dir=str(tmp_path))
        torch.ones(3).sum()
    assert any(e.name == "aten::sum" for e in outer.events())  # (torch let a second one end its session)
    assert not engine.scheduler.profile_in_progress and not list(tmp_path.iterdir())


def test_ranges_cost_no_record_function_when_not_profiling(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """record_function costs ~6 us per range even with no profiler: behind the flag, nothing calls it."""
    import torch

    calls: List[str] = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name: calls.append(name) or real(name))
    engine.generate(PROMPTS, GREEDY)
    assert calls == []
    assert engine.scheduler.trace_range("run_step") is engine.scheduler.trace_range("sample")


def test_engine_shutdown_while_profiling_writes_the_trace(tiny_model: str, tmp_path: Path) -> None:
    import torch

    from minisgl import Engine

    eng = Engine(tiny_model, device="cpu", max_total_tokens=4096)
    eng.start_profile(output_dir=str(tmp_path), with_stack=False)
    eng.generate(PROMPTS[0], GREEDY)
    eng.shutdown()
    assert "run_batch" in range_counts(load_trace(only_trace(tmp_path)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):  # (no profiler left running)
        torch.ones(1).sum()


def test_steps_on_other_threads_are_recorded_and_stopped_safely(engine: Any, tmp_path: Path) -> None:
    """async_generate runs steps in executor threads: a num_steps profile stops in one of them, and an
    explicit stop may come from another thread than the start. torch records only the starting
    thread unless told otherwise, and such a stop crashed the process in export_chrome_trace."""
    import asyncio
    import pathlib

    auto = tmp_path / "auto"
    engine.start_profile(output_dir=pathlib.Path(auto), num_steps=3, activities=("CPU",), with_stack=False)  # (Path, tuple)
    out = asyncio.run(engine.async_generate(PROMPTS[0], GREEDY))
    assert out["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
    assert range_counts(load_trace(only_trace(auto)))["run_batch"] == 3  # the steps of the worker threads

    manual = tmp_path / "manual"
    engine.start_profile(output_dir=str(manual), with_stack=False)
    worker = threading.Thread(target=engine.generate, args=(PROMPTS[1], GREEDY))
    worker.start()
    worker.join()
    stopped: List[str] = []
    stopper = threading.Thread(target=lambda: stopped.extend(engine.stop_profile()))
    stopper.start()
    stopper.join()
    assert stopped == [only_trace(manual)] and range_counts(load_trace(stopped[0]))["run_batch"] >= 1


def test_the_trace_is_written_under_the_write_guard_and_appears_whole(engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server's scheduler pauses its watchdogs through watchdogs_paused while a trace is
    written (a long profile takes minutes to write; the hard watchdog killed the server)."""
    import contextlib

    seen: List[Any] = []

    @contextlib.contextmanager
    def guard() -> Iterator[None]:
        seen.append("enter")
        yield
        seen.append(sorted(p.name for p in tmp_path.iterdir()))  # the trace is written by now

    monkeypatch.setattr(engine.scheduler, "watchdogs_paused", guard)
    engine.start_profile(output_dir=str(tmp_path), with_stack=False)
    engine.generate(PROMPTS[0], GREEDY)
    [path] = engine.stop_profile()
    assert seen == ["enter", [os.path.basename(path)]]  # written inside the guard, no temporary file left
    assert "run_batch" in range_counts(load_trace(path))


def test_an_embedding_engine_profiles_its_prefill_only_steps(tiny_model: str, tmp_path: Path) -> None:
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", max_total_tokens=4096, is_embedding=True) as eng:
        eng.start_profile(output_dir=str(tmp_path), with_stack=False)
        eng.encode(PROMPTS)
        [path] = eng.stop_profile()
    counts = range_counts(load_trace(path))
    assert counts["handle_embedding_request"] == 2 and counts["forward_extend"] == counts["run_batch"] >= 1
    assert "sample" not in counts and "forward_decode" not in counts


# --------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_server_e2e import Server

    env_dir = tmp_path_factory.mktemp("sglang-torch-profiler-dir")
    os.environ["SGLANG_TORCH_PROFILER_DIR"] = str(env_dir)  # (the server process inherits it)
    try:
        s = Server(tiny_model, str(tmp_path_factory.mktemp("srv") / "server.log"))
    finally:
        del os.environ["SGLANG_TORCH_PROFILER_DIR"]
    s.profiler_dir = env_dir
    yield s
    s.stop()


def _error(response: httpx.Response) -> str:
    assert response.status_code == 400, response.text
    body = response.json()["error"]
    assert body["type"] == "BadRequestError" and body["code"] == 400
    return body["message"]


@pytest.mark.e2e
@pytest.mark.slow
def test_server_num_steps_while_requests_stream(server: Any) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    params = dict(model=server.model, max_tokens=STREAM_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                  stream_options={"include_usage": True})  # fmt: skip
    finished: Dict[int, Any] = {}
    first_chunk = threading.Barrier(len(PROMPTS) + 1, timeout=60)

    def stream(i: int) -> None:
        for n, chunk in enumerate(client.completions.create(prompt=PROMPTS[i], stream=True, **params)):
            if n == 0:
                first_chunk.wait()
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                finished[i] = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                finished[i] = (finished.get(i), chunk.usage.completion_tokens)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    first_chunk.wait()  # both decode now; the profile starts in the middle of them
    r = httpx.post(server.url + "/start_profile", json={"num_steps": 3}, timeout=60)
    assert r.status_code == 200 and r.text.startswith("Start profiling.") and str(server.profiler_dir) in r.text
    for t in threads:
        t.join(timeout=60)
    assert [finished.get(i) for i in range(len(PROMPTS))] == [("length", STREAM_TOKENS)] * len(PROMPTS)  # served on, whole
    counts = range_counts(load_trace(only_trace(server.profiler_dir)))  # written by itself, in $SGLANG_TORCH_PROFILER_DIR
    assert counts["run_batch"] == counts["forward_decode"] == counts["process_batch_result_decode"] == 3
    assert STEP_RANGES | {"recv_requests", "send_to_detokenizer"} <= counts.keys()
    assert "Profiling is not in progress" in _error(httpx.post(server.url + "/stop_profile"))


@pytest.mark.e2e
@pytest.mark.slow
def test_server_start_and_stop(server: Any, tmp_path: Path) -> None:
    body = {"output_dir": str(tmp_path), "activities": ["CPU"], "with_stack": False, "record_shapes": None, "profile_prefix": "run1",
            "start_step": None, "profile_by_stage": None, "merge_profiles": False, "profile_stages": None}  # (null: the default)
    r = httpx.post(server.url + "/start_profile", json=body)
    assert r.status_code == 200, r.text
    assert "already in progress. Call /stop_profile first." in _error(httpx.get(server.url + "/start_profile"))
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    r = httpx.get(server.url + "/stop_profile", timeout=60)
    path = only_trace(tmp_path)
    assert r.status_code == 200 and r.text == f"Stop profiling. Wrote {path}.\n"
    assert TRACE_NAME.match(os.path.basename(path))["prefix"] == "run1"
    trace = load_trace(path)
    assert not trace.get("with_stack") and trace.get("record_shapes")
    assert STEP_RANGES | {"handle_generate_request", "forward_extend"} <= range_counts(trace).keys()
    assert "Profiling is not in progress. Call /start_profile first." in _error(httpx.post(server.url + "/stop_profile"))


@pytest.mark.e2e
@pytest.mark.slow
def test_server_refusals_are_400s_and_serving_goes_on(server: Any, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    cases = [
        ({"activities": ["GPU"]}, "Profiling activity 'GPU' records CUDA kernels, and this server runs on cpu"),
        ({"activities": ["MEM"]}, "Profiling activity 'MEM' records the CUDA allocator's history"),
        ({"activities": ["FOO"]}, "Unknown profiling activity 'FOO': choose from CPU, GPU, MEM"),
        ({"activities": ["CUDA_PROFILER"]}, "Profiling activity 'CUDA_PROFILER' is not supported by minisgl"),
        ({"output_dir": str(tmp_path / "a-file" / "x")}, "cannot be written: Not a directory"),
        ({"num_steps": 0}, "num_steps must be a positive integer"),
        ({"num_steps": "3"}, "Invalid parameter 'num_steps'"),
        ({"start_step": 2}, "start_step is not supported by minisgl"),
        ({"merge_profiles": True}, "merge_profiles is not supported by minisgl"),
        ({"profile_stages": ["prefill"]}, "profile_by_stage and profile_stages"),
        ({"record_shape": True}, "Unsupported parameter 'record_shape'"),
    ]
    for body, error in cases:
        assert error in _error(httpx.post(server.url + "/start_profile", json=body)), body
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert "Profiling is not in progress" in _error(httpx.post(server.url + "/stop_profile"))  # none of them started one


@pytest.mark.e2e
@pytest.mark.slow
def test_server_shutdown_while_profiling_writes_the_trace(server: Any, tmp_path: Path) -> None:
    """(Last: it stops the module's server.) A SIGTERM while a profile records writes its trace, as
    Engine.shutdown does; without it a /start_profile with no /stop_profile left nothing."""
    import signal

    r = httpx.post(server.url + "/start_profile", json={"output_dir": str(tmp_path), "with_stack": False})
    assert r.status_code == 200, r.text
    r = httpx.post(server.url + "/v1/completions", json={"model": server.model, "prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 200
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0
    assert "run_batch" in range_counts(load_trace(only_trace(tmp_path)))
