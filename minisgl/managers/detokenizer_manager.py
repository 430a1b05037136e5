"""DetokenizerManager (stage 5, seed 004). In: BatchTokenIDOutput. Out: BatchStrOutput.
(An embedding model's BatchEmbeddingOutput has no text: it passes through unchanged, as in SGLang.)

Owns: its own tokenizer and `decode_status`, one `DecodeStatus` per rid in flight.

The scheduler sends, per emitting request, the *new* token ids; this stage turns them
into the *new* text, so that the concatenation of all deltas of a request is exactly
its final text. The server runs it as its own process (`run_detokenizer_process`:
PULL from the scheduler, PUSH to the TokenizerManager); the in-process Engine calls
`handle_batch_token_id_out` directly. Both paths run the same code.

The incremental algorithm (SGLang's, sglang-facts.md §8), per request:

    decode_ids:  [ ctx ctx ctx | out out out | out out ]
                   ^surr_offset  ^read_offset            ^len(decode_ids)
    surr_text = decode(decode_ids[surr_offset:read_offset])
    read_text = decode(decode_ids[surr_offset:])
    new_text  = read_text[len(surr_text):]

Decoding a window with a little left context and subtracting the context's text gives
the right leading space and merges. When `new_text` ends in U+FFFD (a multi-byte
character cut between tokens) nothing is committed: only its printable head is shown
and the offsets stay, so the next step retries with more bytes. On finish everything
is flushed and the request's state is dropped.

Stop strings are handled on the text side: the matched stop string (and whatever
follows it) is trimmed from the final text, the stop token is left out of the ids
decoded to text unless `no_stop_trim` (`output_ids` still end with it), and while streaming any tail that could be the start of one
of the request's `stop_strs` is held back until a later step decides it. Stop regexes
(`stop_regexes`) likewise: the match is cut, and a stream holds what a match could still take
(sampling/stop_regex.py's `hold_start`).
"""

from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from minisgl.managers.io_struct import (
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    ClearDecodeStatusReq,
    FreezeGCReq,
    decode,
    encode,
)
from minisgl.managers.watchdog import SoftWatchdog
from minisgl.sampling import stop_regex
from minisgl.server_args import PortArgs, ServerArgs
from minisgl.utils import (
    configure_logging,
    freeze_gc,
    get_tokenizer,
    get_zmq_socket,
    kill_itself_when_parent_died,
    leave_ctrl_c_to_the_parent,
)

logger = logging.getLogger("minisgl")

# SGLang's SGLANG_DETOKENIZER_MAX_STATES: a leaked state (a rid that never finishes and
# is never cleared) cannot grow the table without bound; the oldest one is dropped.
DETOKENIZER_MAX_STATES = 1 << 16


@dataclass
class DecodeStatus:
    """Incremental decode state of one request (offsets index `decode_ids`, except sent_offset)."""

    decoded_text: str  # committed output text: final, never changes
    decode_ids: List[int]  # <= 5 prompt ids of left context, then every output id received
    surr_offset: int  # start of the decode window (its left context)
    read_offset: int  # end of the committed ids
    sent_offset: int = 0  # chars of the output text already sent to the client


# ---------------------------------------------------------------------- text helpers
def _is_chinese_char(cp: int) -> bool:
    """CJK Unified Ideographs blocks (a CJK char is a whole word: safe to show at once)."""
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def find_printable_text(text: str) -> str:
    """The head of an uncommitted `text` that later tokens cannot change.

    After a newline, everything; after a CJK char, everything; when the char before the
    last is CJK, all but the last; otherwise up to and including the last space (a word
    may still grow, and a trailing U+FFFD is never included).
    """
    if text.endswith("\n"):
        return text
    if len(text) > 0 and _is_chinese_char(ord(text[-1])):
        return text
    if len(text) > 1 and _is_chinese_char(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


def trim_matched_stop(
    output: Union[str, List[int]],
    finished_reason: Optional[Dict[str, Any]],
    no_stop_trim: bool,
    stop_strs: Sequence[str] = (),
    stop_regexes: Sequence[str] = (),
    sent: int = 0,
) -> Union[str, List[int]]:
    """Cut the matched stop from a finished request: a stop string or a stop regex's match from
    text, a stop token from ids.

    With `no_stop_trim` a stop token stays, and a stop string (or match) stays but what follows
    it in the same step is still cut (generation stopped there). A finish reason names a regex
    by its pattern, as SGLang's does: `stop_regexes` (the request's) says which patterns to
    search for rather than find as they are spelled; the search starts at `sent` (the text
    already sent held no match, so only the held-back rest is searched).
    """
    if not finished_reason or finished_reason.get("type") != "stop":
        return output
    matched = finished_reason.get("matched")
    if isinstance(matched, str) and isinstance(output, str):
        spans = []
        if matched in stop_regexes:
            span = stop_regex.cut_span(matched, output, sent)
            if span is not None:
                spans.append(span)
        if matched not in stop_regexes or matched in stop_strs:
            pos = output.find(matched)
            if pos != -1:
                spans.append((pos, pos + len(matched)))
        if not spans:
            return output
        start, end = min(spans)
        return output[:end] if no_stop_trim else output[:start]
    if isinstance(matched, int) and isinstance(output, list) and not no_stop_trim:
        # The scheduler puts the stop token last in output_ids; it finished on it.
        return output[:-1] if output and output[-1] == matched else output
    return output


def stop_str_safe_len(text: str, stop_strs: Sequence[str], start: int = 0, stop_regexes: Sequence[str] = ()) -> int:
    """How many leading chars of a streaming `text` cannot be part of a stop string or a stop
    regex's match.

    Everything from the first full occurrence of a stop string on, and any tail that is
    a prefix of a stop string, is held back: a later step decides whether it was one; so is
    everything from where a regex matches, or could still match if more text came.
    `start` (the sent offset) bounds the search: no occurrence can begin before it,
    because the start of every occurrence was a held-back prefix when it arrived.
    """
    safe = stop_regex.hold_start(stop_regexes, text, start) if stop_regexes else len(text)
    for stop in stop_strs:
        if not stop:
            continue
        pos = text.find(stop, start)
        if pos != -1:
            safe = min(safe, pos)
        # The longest proper prefix of `stop` that `text` ends with, starting at or after `start`
        # (the unsent text bounds it: a long stop string cost len(stop)^2 per step otherwise).
        for k in range(min(len(stop) - 1, len(text) - start), 0, -1):
            if text.endswith(stop[:k]):
                safe = min(safe, len(text) - k)
                break
    return safe


class DetokenizerManager:
    def __init__(self, server_args: ServerArgs, port_args: Optional[PortArgs] = None) -> None:
        path = server_args.tokenizer_path or server_args.model_path
        if path is None:
            raise ValueError("DetokenizerManager needs server_args.tokenizer_path (resolve_server_args fills it)")
        self.server_args = server_args
        self.tokenizer = get_tokenizer(path, trust_remote_code=server_args.trust_remote_code)
        self.decode_status: "OrderedDict[str, DecodeStatus]" = OrderedDict()
        # The rids being worked on, read by the soft watchdog's log line.
        self.cur_rids: List[str] = []
        self._request_dispatcher: Dict[type, Callable[[Any], Optional[Union[BatchStrOutput, BatchEmbeddingOutput]]]] = {
            BatchTokenIDOutput: self.handle_batch_token_id_out,
            BatchEmbeddingOutput: self.handle_batch_embedding_out,
            ClearDecodeStatusReq: self.handle_clear_decode_status,
            FreezeGCReq: self.handle_freeze_gc,
        }
        self.soft_watchdog: Optional[SoftWatchdog] = None
        self.recv_from_scheduler: Any = None
        self.send_to_tokenizer: Any = None
        if port_args is not None:
            self.init_ipc_channels(port_args)

    # ------------------------------------------------------------------ process shell
    def init_ipc_channels(self, port_args: PortArgs) -> None:
        import zmq

        self._zmq_context = zmq.Context(2)
        self.recv_from_scheduler = get_zmq_socket(self._zmq_context, zmq.PULL, port_args.detokenizer_ipc_name, bind=True)
        self.send_to_tokenizer = get_zmq_socket(self._zmq_context, zmq.PUSH, port_args.tokenizer_ipc_name, bind=False)

    def event_loop(self) -> None:
        """recv -> dispatch -> send -> feed the watchdog; forever (the process dies with its parent)."""
        assert self.recv_from_scheduler is not None, "call init_ipc_channels first"
        self.soft_watchdog = SoftWatchdog("Detokenizer", self.server_args.soft_watchdog_timeout, self._describe)
        while True:
            with self.soft_watchdog.disable():
                recv = decode(self.recv_from_scheduler.recv())
            out = self.dispatch(recv)
            if out is not None:
                self.send_to_tokenizer.send(encode(out))
            self.cur_rids = []
            self.soft_watchdog.feed()

    def _describe(self) -> str:
        return f"current batch rids={self.cur_rids}, #decode-status={len(self.decode_status)}"

    def dispatch(self, recv: Any) -> Optional[Union[BatchStrOutput, BatchEmbeddingOutput]]:
        """Route a message by its type; an unknown type is an error, never ignored."""
        handler = self._request_dispatcher.get(type(recv))
        if handler is None:
            raise TypeError(f"DetokenizerManager cannot handle a {type(recv).__name__}")
        out = handler(recv)
        logger.debug(f"Detokenizer: handled {type(recv).__name__}, #decode-status: {len(self.decode_status)}")
        return out

    def handle_batch_embedding_out(self, recv: BatchEmbeddingOutput) -> BatchEmbeddingOutput:
        """Embeddings have no text: on to the TokenizerManager as they are (SGLang's)."""
        return recv

    def handle_freeze_gc(self, recv: FreezeGCReq) -> None:
        freeze_gc("Detokenizer")

    def handle_clear_decode_status(self, recv: ClearDecodeStatusReq) -> None:
        """Drop the state of these rids (SGLang's message; minisgl sends none: docs/detokenizer.md)."""
        for rid in recv.rids:
            self.decode_status.pop(rid, None)
        return None

    # ------------------------------------------------------------------ the algorithm
    def handle_batch_token_id_out(self, recv: BatchTokenIDOutput) -> BatchStrOutput:
        """New ids of every emitting request -> their new text. Pure: no I/O."""
        bs = len(recv.rids)
        self.cur_rids = list(recv.rids)
        states = [self._update_status(recv, i) for i in range(bs)]

        # The window with its left context, and the left context alone; the stop token is
        # cut from the window of a finished request before decoding.
        read_ids: List[List[int]] = []
        surr_ids: List[List[int]] = []
        for i, s in enumerate(states):
            read_ids.append(trim_matched_stop(s.decode_ids[s.surr_offset :], recv.finished_reasons[i], recv.no_stop_trim[i]))  # (ids: a stop token)
            surr_ids.append(s.decode_ids[s.surr_offset : s.read_offset])
        # One decode call per flag group for both lists together.
        texts = self._grouped_batch_decode(
            surr_ids + read_ids,
            list(recv.skip_special_tokens) * 2,
            list(recv.spaces_between_special_tokens) * 2,
        )
        surr_texts, read_texts = texts[:bs], texts[bs:]

        output_strs = [self._emit(recv, i, states[i], surr_texts[i], read_texts[i]) for i in range(bs)]
        return BatchStrOutput(
            rids=list(recv.rids),
            finished_reasons=list(recv.finished_reasons),
            output_strs=output_strs,
            output_ids=list(recv.output_ids),
            prompt_tokens=list(recv.prompt_tokens),
            completion_tokens=list(recv.completion_tokens),
            cached_tokens=list(recv.cached_tokens),
            time_stats=list(recv.time_stats),
            # passed through, as the logprobs: float32 rows, views of the received frame, re-sent as bytes
            output_hidden_states=list(recv.output_hidden_states),
            spec_verify_ct=list(recv.spec_verify_ct),
            **recv.logprob_lists(),
        )

    def _update_status(self, recv: BatchTokenIDOutput, i: int) -> DecodeStatus:
        """Append row i's delta ids to its rid's state, creating the state on first emission."""
        rid = recv.rids[i]
        s = self.decode_status.get(rid)
        if s is None:
            # First emission: decode_ids = left context + output, read_offset = output start.
            s = DecodeStatus(
                decoded_text="",
                decode_ids=list(recv.decode_ids[i]),
                surr_offset=self._context_start(recv, i),
                read_offset=recv.read_offsets[i],
            )
            self.decode_status[rid] = s
            if len(self.decode_status) > DETOKENIZER_MAX_STATES:
                old_rid, _ = self.decode_status.popitem(last=False)
                logger.warning(f"Detokenizer: more than {DETOKENIZER_MAX_STATES} states; dropped the oldest, rid={old_rid}")
        else:
            s.decode_ids.extend(recv.decode_ids[i])
        return s

    def _context_start(self, recv: BatchTokenIDOutput, i: int) -> int:
        """Where row i's left context starts: on a character boundary.

        The five prompt ids can begin inside a character. Its orphan bytes decode to U+FFFD,
        which a byte-level BPE keeps to those bytes, but a byte-fallback decoder (Llama-2,
        Mistral: <0xNN> tokens) turns the whole run of byte tokens into U+FFFD, the output's
        own bytes in that run included, and the committed text would stay wrong."""
        ids, read_offset = recv.decode_ids[i], recv.read_offsets[i]
        start = 0
        while start < read_offset and self.tokenizer.decode(
            ids[start:read_offset],
            skip_special_tokens=recv.skip_special_tokens[i],
            spaces_between_special_tokens=recv.spaces_between_special_tokens[i],
        ).startswith("\ufffd"):
            start += 1
        return start

    def _emit(self, recv: BatchTokenIDOutput, i: int, s: DecodeStatus, surr_text: str, read_text: str) -> str:
        """Advance row i's state with its decoded window and return the text delta to send."""
        new_text = read_text[len(surr_text) :]
        finished = recv.finished_reasons[i] is not None
        if finished:
            if new_text.endswith("\ufffd"):  # the answer ends inside a character (cut by max_tokens)
                new_text = self._commit_whole_characters(recv, i, s)
            # Flush everything, trim the matched stop string, forget the request.
            output_str = trim_matched_stop(
                s.decoded_text + new_text, recv.finished_reasons[i], recv.no_stop_trim[i], recv.stop_strs[i], recv.stop_regexes[i],
                s.sent_offset,
            )  # fmt: skip
            del self.decode_status[recv.rids[i]]
            return output_str[s.sent_offset :]

        if new_text and not new_text.endswith("\ufffd"):
            # Complete characters: commit and slide the window (old read end = new context start).
            s.decoded_text += new_text
            s.surr_offset = s.read_offset
            s.read_offset = len(s.decode_ids)
            new_text = ""
        else:
            # An incomplete character (or nothing yet): show what cannot change, commit nothing.
            new_text = find_printable_text(new_text)
        output_str = s.decoded_text + new_text
        # invariant: the sent text is a prefix of every later output_str of this request.
        safe = stop_str_safe_len(output_str, recv.stop_strs[i], s.sent_offset, recv.stop_regexes[i])
        if safe <= s.sent_offset:
            return ""
        delta = output_str[s.sent_offset : safe]
        s.sent_offset = safe
        return delta

    def _commit_whole_characters(self, recv: BatchTokenIDOutput, i: int, s: DecodeStatus) -> str:
        """At a finish that ends inside a character: commit, token by token, what a stream would
        have committed, then return the rest decoded after it.

        A byte-fallback decoder (Llama-2, Mistral: <0xNN> tokens) turns a whole run of byte
        tokens into one U+FFFD per token when the run ends in an incomplete character, so
        decoding a non-streaming answer's window at once lost the complete characters of that
        run (a newline, a CJK character) that a stream had sent. Only this rare finish pays
        the per-token decodes."""
        kwargs = dict(skip_special_tokens=recv.skip_special_tokens[i], spaces_between_special_tokens=recv.spaces_between_special_tokens[i])
        for k in range(s.read_offset + 1, len(s.decode_ids)):
            surr_text = self.tokenizer.decode(s.decode_ids[s.surr_offset : s.read_offset], **kwargs)
            new_text = self.tokenizer.decode(s.decode_ids[s.surr_offset : k], **kwargs)[len(surr_text) :]
            if new_text and not new_text.endswith("\ufffd"):
                s.decoded_text += new_text
                s.surr_offset, s.read_offset = s.read_offset, k
        surr_text = self.tokenizer.decode(s.decode_ids[s.surr_offset : s.read_offset], **kwargs)
        return self.tokenizer.decode(s.decode_ids[s.surr_offset :], **kwargs)[len(surr_text) :]

    def _grouped_batch_decode(
        self,
        ids_list: List[List[int]],
        skip_list: List[bool],
        space_list: List[bool],
    ) -> List[str]:
        """`tokenizer.batch_decode` once per (skip_special_tokens, spaces_between_special_tokens) group."""
        groups: Dict[Tuple[bool, bool], List[int]] = {}
        for i, key in enumerate(zip(skip_list, space_list)):
            groups.setdefault(key, []).append(i)
        texts: List[str] = [""] * len(ids_list)
        for (skip, spaces), rows in groups.items():
            decoded = self.tokenizer.batch_decode(
                [ids_list[r] for r in rows],
                skip_special_tokens=skip,
                spaces_between_special_tokens=spaces,
            )
            for r, text in zip(rows, decoded):
                texts[r] = text
        return texts


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, pipe_writer: Any) -> None:
    """Entry point of the detokenizer process (multiprocessing spawn target)."""
    kill_itself_when_parent_died()
    leave_ctrl_c_to_the_parent()
    configure_logging(server_args.log_level, prefix="Detokenizer")
    try:
        manager = DetokenizerManager(server_args, port_args)
        pipe_writer.send({"status": "ready"})
        manager.event_loop()
    except Exception as e:
        if isinstance(e, ValueError):  # e.g. a tokenizer it cannot load: the message says which
            logger.error("DetokenizerManager failed: %s", e)
        else:
            logger.exception("DetokenizerManager hit an exception")
        try:
            pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        except (OSError, ValueError):
            # The parent already closed its end of the pipe; the exit code still says we failed.
            logger.error("Detokenizer: could not report the error to the parent")
        sys.exit(1)
