"""The detokenizer as a real process: spawn, real ZMQ ipc sockets, the soft watchdog, state cleanup.

The test plays both neighbours of the detokenizer: the scheduler (PUSH connect to
detokenizer_ipc_name) and the TokenizerManager (PULL bind on tokenizer_ipc_name).
The child runs the real `run_detokenizer_process`; the only test-only piece is the
child's tokenizer wrapper, which sleeps in `batch_decode` whenever a row contains
SLOW_ID, so one message stalls an iteration and the watchdog must say so.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import sys
import time
from typing import Any, List

import pytest

from minisgl.managers.io_struct import BatchStrOutput, BatchTokenIDOutput, ClearDecodeStatusReq, decode, encode
from minisgl.server_args import PortArgs, ServerArgs
from minisgl.test_utils import train_tokenizer

SLOW_ID = 0  # <|endoftext|>: never in the ordinary messages of this test
SLOW_SECONDS = 1.5
WATCHDOG_TIMEOUT = 0.5


class SlowTokenizer:
    """Delegates to a real tokenizer; batch_decode stalls on rows containing SLOW_ID."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def batch_decode(self, ids_list: List[List[int]], **kwargs: Any) -> List[str]:
        if any(SLOW_ID in ids for ids in ids_list):
            time.sleep(SLOW_SECONDS)
        return self.tokenizer.batch_decode(ids_list, **kwargs)

    def __getattr__(self, name: str) -> Any:  # everything else (decode, ...) as the real one
        return getattr(self.tokenizer, name)


def _child_main(server_args: ServerArgs, port_args: PortArgs, pipe_writer: Any, log_path: str) -> None:
    """Spawn target: send the child's stderr (its log) to a file, slow tokenizer, then the real entry point."""
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    import minisgl.managers.detokenizer_manager as dm

    real_get_tokenizer = dm.get_tokenizer
    dm.get_tokenizer = lambda path, **kw: SlowTokenizer(real_get_tokenizer(path, **kw))
    dm.run_detokenizer_process(server_args, port_args, pipe_writer)


def _msg(rid: str, decode_ids: List[int], read_offset: int, finished: bool) -> BatchTokenIDOutput:
    return BatchTokenIDOutput(
        rids=[rid],
        finished_reasons=[{"type": "length", "length": 9} if finished else None],
        decode_ids=[decode_ids],
        read_offsets=[read_offset],
        output_ids=[decode_ids[read_offset:]],
        skip_special_tokens=[True],
        spaces_between_special_tokens=[True],
        no_stop_trim=[False],
        stop_strs=[[]],
        stop_regexes=[[]],
        prompt_tokens=[read_offset],
        completion_tokens=[len(decode_ids) - read_offset],
        cached_tokens=[0],
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("detok-proc-tokenizer")
    tok = train_tokenizer()
    tok.save_pretrained(str(path))
    return str(path)


def _decode_status_counts(log_text: str) -> List[int]:
    return [int(n) for n in re.findall(r"#decode-status: (\d+)", log_text)]


@pytest.mark.slow
def test_detokenizer_process_end_to_end(tokenizer_dir: str, tmp_path: Any) -> None:
    import zmq

    from minisgl.utils import get_tokenizer, get_zmq_socket

    tok = get_tokenizer(tokenizer_dir)
    port_args = PortArgs.init_new(str(tmp_path))
    server_args = ServerArgs(tokenizer_path=tokenizer_dir, soft_watchdog_timeout=WATCHDOG_TIMEOUT, log_level="debug")
    log_path = str(tmp_path / "detokenizer.log")
    ctx = zmq.Context()
    recv_from_detok = get_zmq_socket(ctx, zmq.PULL, port_args.tokenizer_ipc_name, bind=True)
    send_to_detok = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
    spawn = mp.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_child_main, args=(server_args, port_args, writer, log_path), daemon=True)
    proc.start()
    try:
        assert reader.poll(120), "detokenizer did not report readiness"
        assert reader.recv() == {"status": "ready"}

        def roundtrip(msg: Any) -> BatchStrOutput:
            send_to_detok.send(encode(msg))
            assert recv_from_detok.poll(30_000), "no reply from the detokenizer"
            return decode(recv_from_detok.recv())

        prompt = tok.encode("Say hi:", add_special_tokens=False)
        out_ids = tok.encode(" 你好 world", add_special_tokens=False)
        ctx_ids = prompt[-5:]
        first = roundtrip(_msg("a", ctx_ids + out_ids[:2], len(ctx_ids), finished=False))
        rest = roundtrip(_msg("a", out_ids[2:], 0, finished=True))
        assert isinstance(rest, BatchStrOutput) and rest.rids == ["a"]
        assert "\ufffd" not in first.output_strs[0]
        assert first.output_strs[0] + rest.output_strs[0] == " 你好 world"
        assert rest.finished_reasons == [{"type": "length", "length": 9}] and rest.output_ids == [out_ids[2:]]

        # Started, then aborted upstream: ClearDecodeStatusReq frees it (no reply is sent).
        roundtrip(_msg("b", out_ids[:3], 0, finished=False))
        send_to_detok.send(encode(ClearDecodeStatusReq(rids=["b"])))

        # One stalled iteration: the watchdog names the batch's rid in the log.
        slow = roundtrip(_msg("slow-req", tok.encode("zz", add_special_tokens=False) + [SLOW_ID], 0, finished=True))
        assert slow.output_strs == ["zz"]
        time.sleep(2 * WATCHDOG_TIMEOUT)  # idle now: waiting for input must not count as a stall
        log_text = open(log_path).read()
        # (a loaded machine may stall another iteration too: the slow one is reported once)
        timeout_lines = [line for line in log_text.splitlines() if "Detokenizer watchdog timeout" in line and "slow-req" in line]
        assert len(timeout_lines) == 1, log_text
        assert "batch_decode" in log_text  # the stack of the stuck loop points at the slow call
        # Every request finished or was cleared: the state table is empty again.
        counts = _decode_status_counts(log_text)
        assert counts[-1] == 0 and max(counts) >= 1, counts
        assert proc.is_alive()
    finally:
        proc.terminate()
        proc.join(10)
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_detokenizer_process_reports_startup_error(tmp_path: Any) -> None:
    port_args = PortArgs.init_new(str(tmp_path))
    server_args = ServerArgs(tokenizer_path=str(tmp_path / "no-such-tokenizer"))
    spawn = mp.get_context("spawn")
    reader, writer = spawn.Pipe(duplex=False)
    proc = spawn.Process(target=_child_main, args=(server_args, port_args, writer, str(tmp_path / "err.log")), daemon=True)
    proc.start()
    try:
        assert reader.poll(120)
        msg = reader.recv()
        assert msg["status"] == "error" and "no-such-tokenizer" in msg["message"]
        proc.join(30)
        assert proc.exitcode not in (None, 0)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(10)
