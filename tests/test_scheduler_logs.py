"""The scheduler's log lines, in SGLang's format (sglang-facts §1.9): one prefill line per
extend, a decode line every --decode-log-interval decode steps, a warning on retraction."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from minisgl import Engine

GREEDY = {"temperature": 0, "ignore_eos": True}
PREFILL = re.compile(
    r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), token usage: \d+\.\d\d, "
    r"#running-req: \d+, #queue-req: (\d+), input throughput \(token/s\): [\d.]+, cpu graph: False"
)
DECODE = re.compile(
    r"Decode batch, #running-req: (\d+), #token: \d+, token usage: \d+\.\d\d, cpu graph: False, "
    r"gen throughput \(token/s\): [\d.]+, #queue-req: \d+"
)


def _lines(caplog: pytest.LogCaptureFixture, pattern: re.Pattern) -> list:
    return [m for r in caplog.records if (m := pattern.fullmatch(r.getMessage()))]


def test_prefill_and_decode_lines(tiny_model: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine(tiny_model, device="cpu", decode_log_interval=4)
    shared = list(range(20, 60))
    with caplog.at_level(logging.INFO, logger="minisgl"):
        engine.generate(input_ids=[shared + [1], shared + [2]], sampling_params={**GREEDY, "max_new_tokens": 13})
        engine.generate(input_ids=shared + [3], sampling_params={**GREEDY, "max_new_tokens": 2})
    prefills = _lines(caplog, PREFILL)
    assert [(int(m[1]), int(m[2]), int(m[3])) for m in prefills] == [(2, 82, 0), (1, 1, 40)]  # the 2nd hits the cache
    decodes = _lines(caplog, DECODE)
    # the pair decodes 12 steps (logged at 4, 8, 12); the third request's one decode step is the 13th
    assert len(decodes) == 3 and all(int(m[1]) == 2 for m in decodes)


def test_retraction_warning(tiny_model: str, caplog: pytest.LogCaptureFixture) -> None:
    # as in test_scheduler_retract: a low initial new_token_ratio overcommits the pool
    engine = Engine(tiny_model, device="cpu", max_total_tokens=120, chunked_prefill_size=-1, schedule_conservativeness=0.1)
    prompts = [[10 + i, 20 + i, 30 + i] * 4 for i in range(16)]
    with caplog.at_level(logging.WARNING, logger="minisgl"):
        engine.generate(input_ids=prompts, sampling_params=[{**GREEDY, "max_new_tokens": 20 + i} for i in range(16)])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    pattern = (r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+), #new_tokens_gained: (\d+), "
               r"#new_token_ratio: (0\.\d{4}) -> (\d\.\d{4})")
    lines = [m for m in (re.fullmatch(pattern, w) for w in warnings) if m]
    assert lines, warnings
    for m in lines:  # each line: at least one request retracted, tokens freed, the ratio raised
        assert int(m[1]) >= 1 and int(m[2]) > 0 and float(m[4]) > float(m[3]), m[0]
    assert sum(int(m[1]) for m in lines) == engine.get_load().num_retracted_reqs_total


def test_get_load_reports_the_decode_logs_gen_throughput_while_requests_run(tiny_model: str) -> None:
    """sglang:gen_throughput: the rate of the last decode log line; 0 once nothing runs."""
    from minisgl import Engine

    with Engine(tiny_model, device="cpu", decode_log_interval=1) as engine:
        engine.add_request(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}, rid="r")
        for _ in range(4):  # a prefill, then decode steps that each log
            engine.step()
        running = engine.get_load().gen_throughput
        engine.run_until_idle()
        engine.get_result("r")
        assert running > 0 and engine.get_load().gen_throughput == 0.0


def test_gen_throughput_after_an_idle_period_measures_the_new_busy_period(tiny_model: str, monkeypatch: Any) -> None:
    """The rate's window ran from the previous burst's last log line: idle time diluted it
    (3.9 tok/s for a request decoding at ~250). The scheduler's clock is a hand-set one here."""
    import time
    import types

    from minisgl import Engine
    from minisgl.managers import scheduler, scheduler_metrics_mixin

    clock = [0.0]
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time, monotonic=time.monotonic)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_model, device="cpu", decode_log_interval=2) as engine:
        monkeypatch.setattr(scheduler, "time", fake)
        monkeypatch.setattr(scheduler_metrics_mixin, "time", fake)
        engine.generate(input_ids=[5, 6, 7], sampling_params=params)
        engine.step()  # idle
        clock[0] = 1000.0  # an idle spell of 1,000 s
        engine.add_request(input_ids=[8, 9, 10], sampling_params={**params, "max_new_tokens": 40}, rid="r")
        assert engine.get_load().gen_throughput == 0.0  # nothing measured in this period yet
        engine.step()  # the prefill: the period starts here
        clock[0] = 1001.0
        engine.step()
        engine.step()  # two decode steps: the period's first log line comes in them
        # 1 or 2 tokens in 1 s, by where the line falls (idle-diluted: ~3 tokens / 1,001 s)
        assert engine.get_load().gen_throughput in (1.0, 2.0)
        engine.run_until_idle()
        engine.get_result("r")
