"""Grammar backend (stage 3, inside the Scheduler): a request's json_schema / regex / ebnf /
structural_tag -> a matcher that says, before every sample, which tokens keep the output inside the grammar.

Where it sits: Scheduler.handle_generate_request -> XGrammarGrammarBackend.get_future(key)
(compiled on one of the backend's threads; the request waits in the scheduler's grammar_queue
until it is) -> `get_grammar(future)` -> `Req.grammar` (one matcher per request, never sent
across a process boundary). Before each sample, SamplingBatchInfo.from_reqs asks every such
request's grammar to fill its row of the batch's vocab mask (`fill_vocab_mask`), and
`apply_vocab_mask` (xgrammar's kernel; a torch reference beside it) sets the forbidden
tokens' logits to -inf after the penalties. After each sample, the output processor feeds
the token to `accept_token`; a grammar that reached its end (`is_terminated`, after it
accepted a stop token) finishes the request (Req.check_finished).

The grammar machinery is xgrammar's, as SGLang's default backend: it compiles a grammar
against the tokenizer's vocabulary once (cached by its (type, text) key, as SGLang's
grammar cache), and its matcher fills a bitmask of 32 tokens per int32 in microseconds.
xgrammar is an optional dependency (the `grammar` extra, `pip install -e ".[grammar]"`): it pulls in triton,
a gigabyte the CPU engine has no other use for; a server without it refuses structured
output requests with a 400 that says what to install.

Compiling is off the scheduler's thread, as in SGLang: most schemas take a millisecond or
two, but the time grows with nesting (a 10 KB schema of arrays nested 400 deep took 6 s at
the built-in model's vocabulary), and every other request would wait for it. xgrammar
releases the GIL while it compiles, so the scheduler's steps go on meanwhile.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import re
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

logger = logging.getLogger("minisgl.constrained")

# compiled grammars kept (SGLang keeps them all; a long-running server with a schema per
# request would grow without bound)
GRAMMAR_CACHE_SIZE = 256
# compile threads: xgrammar releases the GIL, and each compile runs one thread of its own
GRAMMAR_COMPILE_THREADS = 2
XGRAMMAR_MISSING = (
    "Structured output (json_schema, regex, ebnf, structural_tag, response_format, forced or strict tool calls) needs "
    'xgrammar, which is not installed: pip install xgrammar (minisgl\'s "grammar" extra; in a checkout: pip install -e '
    '".[grammar]"), then restart the server or the Engine'
)


# the backends whose threads still run, shut down at exit (see XGrammarGrammarBackend.__init__)
_LIVE_BACKENDS: "weakref.WeakSet[XGrammarGrammarBackend]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_backends() -> None:
    for backend in list(_LIVE_BACKENDS):
        backend.shutdown()


class XGrammarGrammar:
    """One request's place in its grammar (xgrammar's GrammarMatcher), advanced token by token."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Row `idx` of vocab_mask [bs, ceil(V / 32)] int32: bit t set iff token t may come next."""
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    def accept_token(self, token: int) -> None:
        """Advance past `token`; ValueError if the grammar does not allow it there."""
        if not self.matcher.accept_token(token):
            raise ValueError(f"token {token} does not continue the output inside its grammar")

    def is_terminated(self) -> bool:
        """The output is complete and the grammar accepted a stop token after it."""
        return self.matcher.is_terminated()


class XGrammarGrammarBackend:
    """Compiles grammars against one tokenizer's vocabulary, on threads of its own (SGLang's
    XGrammarGrammarBackend and the thread pool of its grammar manager).

    `vocab_size` is the model's (the logits' width), which may exceed the tokenizer's: the
    ids past the tokenizer are never allowed. `stop_token_ids` are the ids that end a
    grammar's output (the scheduler's EOS set).
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], any_whitespace: bool = True
    ) -> None:
        try:
            import xgrammar
        except ImportError as e:
            raise ImportError(XGRAMMAR_MISSING) from e
        self._xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        # one thread per compile (xgrammar's own parallelism off): the forward's OpenMP threads
        # already own the cores, and the backend runs GRAMMAR_COMPILE_THREADS compiles at most
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.vocab_size = vocab_size
        self.any_whitespace = any_whitespace
        # (type, text) -> the future of its compiled grammar; touched by the scheduler's thread only
        self._cache: "OrderedDict[Tuple[str, str], Future]" = OrderedDict()
        self._jobs: "queue.Queue[Optional[Tuple[Tuple[str, str], Future]]]" = queue.Queue()
        # Several threads, so that a huge schema does not hold up every small grammar behind it.
        # Daemon threads, joined by shutdown() (Engine.shutdown, and at exit: a daemon thread
        # that comes back from xgrammar's C++ while the interpreter finalizes aborts the process
        # with "terminate called without an active exception"). They hold the backend only while
        # they compile: an Engine dropped without shutdown() (a notebook cell run again) lets it
        # go, and its finalizer ends them, where they kept it, its compiler and its cache, for good.
        self._threads = [
            threading.Thread(
                target=_compile_loop, args=(weakref.ref(self), self._jobs), name=f"minisgl-grammar-compiler-{i}", daemon=True
            )
            for i in range(GRAMMAR_COMPILE_THREADS)
        ]
        for thread in self._threads:
            thread.start()
        weakref.finalize(self, _end_threads, self._jobs, len(self._threads))
        _LIVE_BACKENDS.add(self)

    def get_future(self, key: Tuple[str, str]) -> Future:
        """The future of (type, text)'s compiled grammar, type "json_schema", "regex" or "ebnf"
        (SamplingParams.grammar_key): done at once for a cached key, else compiled on one of the
        backend's threads. A text that does not compile is cached too, as its error."""
        future = self._cache.get(key)
        if future is None or future.cancelled():
            future = self._cache[key] = Future()
            self._jobs.put((key, future))
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def reset(self) -> None:
        """Forget the compiled grammars (Scheduler.flush_cache, as SGLang's grammar_backend.reset)."""
        self._cache.clear()

    def shutdown(self, timeout: float = 60.0) -> None:
        """Skip the compiles not started, let the threads end, and wait for them up to `timeout`
        (a compile that has started runs to its end: xgrammar cannot stop it)."""
        for future in self._cache.values():
            future.cancel()
        self._cache.clear()
        for _ in self._threads:
            self._jobs.put(None)  # (one per thread: each ends at its first)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))
        if not any(thread.is_alive() for thread in self._threads):  # (else exit joins them)
            _LIVE_BACKENDS.discard(self)

    def release(self, future: Future) -> None:
        """No request waits for `future` any more: a compile not yet started is skipped (one
        running goes on: xgrammar cannot stop it)."""
        future.cancel()

    def get_grammar(self, future: Future) -> XGrammarGrammar:
        """A fresh matcher from a done future; ValueError (a 400) naming the field when its text did not compile."""
        if future.cancelled():  # (never for a request still waiting: see Scheduler._release_grammar_future)
            raise ValueError("its grammar's compile was cancelled")
        error = future.exception()
        if error is not None:
            # a fresh exception: re-raising the cached one grew its traceback at every refusal,
            # keeping each refused request (and its frames) alive
            raise ValueError(str(error))
        return XGrammarGrammar(self._xgr.GrammarMatcher(future.result()))

    def _compile_structural_tag(self, text: str) -> Any:
        """Free text in which what follows a trigger must be one of the tagged structures: SGLang's
        shape ("structures" + "triggers", its tool-call constraint's too) or xgrammar's ("format")."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "format" not in tag:
            tags, triggers = _legacy_tags(tag, self._xgr)
            with warnings.catch_warnings():  # (xgrammar calls this shape deprecated; SGLang sends it)
                warnings.simplefilter("ignore", DeprecationWarning)
                return self.compiler.compile_structural_tag(tags, triggers)
        return self.compiler.compile_structural_tag(text)

    def _compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "json_schema":
                return self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return self.compiler.compile_regex(text)
            if kind == "ebnf":
                return self.compiler.compile_grammar(text)
            if kind == "structural_tag":
                return self._compile_structural_tag(text)
        except (RuntimeError, ValueError) as e:  # xgrammar's parse errors are RuntimeErrors
            raise ValueError(f"Invalid {kind}: {_first_line(str(e))}") from None
        except RecursionError:
            raise ValueError(f"Invalid {kind}: nested too deeply") from None
        raise ValueError(f"unknown grammar type {kind!r}; expected json_schema, regex, ebnf or structural_tag")


def _legacy_tags(tag: Dict[str, Any], xgrammar: Any) -> Tuple[List[Any], List[str]]:
    """SGLang's structural tag shape, {"structures": [{"begin", "schema", "end"}], "triggers": [...]},
    as xgrammar's (tags, triggers); ValueError naming what is missing."""
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or not all(isinstance(t, str) for t in triggers):
        raise ValueError('needs "structures" (a list of {"begin", "schema", "end"}) and "triggers" (a list of strings)')
    tags = []
    for s in structures:
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)):
            raise ValueError(f'each structure needs a "begin" and an "end" string, got {json.dumps(s)[:200]}')
        schema = s.get("schema")
        tags.append(xgrammar.StructuralTagItem(begin=s["begin"], schema=json.dumps(schema if schema is not None else {}), end=s["end"]))
    return tags, triggers


def _compile_loop(backend_ref: "weakref.ref[XGrammarGrammarBackend]", jobs: "queue.Queue[Any]") -> None:
    """A compile thread: takes jobs until a None (shutdown, or the backend was collected)."""
    while True:
        job = jobs.get()
        if job is None:
            return
        key, future = job
        if not future.set_running_or_notify_cancel():  # (released before its turn)
            continue
        backend = backend_ref()
        if backend is None:  # (collected after the job was queued: nobody waits for it)
            future.set_exception(RuntimeError("the grammar backend was shut down"))
            return
        try:
            future.set_result(backend._compile(*key))
        except BaseException as e:  # (delivered to the request that waits for it; without the
            # traceback, whose frames would hold the backend from its own cache)
            future.set_exception(e.with_traceback(None))
        del backend


def _end_threads(jobs: "queue.Queue[Any]", n: int) -> None:
    """A collected backend's finalizer: one None per compile thread, each ends at its first."""
    for _ in range(n):
        jobs.put(None)


def _first_line(message: str) -> str:
    """xgrammar's message without its C++ source location ("[12:09:14] /project/cpp/x.cc:94: ")
    and its internal check ("Check failed: (lower >= 0) is false: "); never empty."""
    line = (message.strip().splitlines() or [""])[0]
    line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)
    line = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)
    return line or "xgrammar could not compile it"


def allocate_vocab_mask(vocab_size: int, batch_size: int, device: Any = "cpu") -> torch.Tensor:
    """[bs, ceil(V / 32)] int32, every bit set: every token allowed (the rows of requests without a grammar)."""
    return torch.full((batch_size, (vocab_size + 31) // 32), -1, dtype=torch.int32, device=device)


def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor, rows: List[int]) -> None:
    """logits [bs, V] in place: -inf in `rows` wherever vocab_mask [bs, ceil(V / 32)] has the token's bit clear.

    xgrammar's kernel (C++ on the CPU, Triton/CUDA on a GPU), as SGLang's: on the rows that
    have a grammar only, where the torch reference below reads every row. At the built-in
    model's 4,096 tokens and 64 rows it takes ~0.6 ms for all rows against the reference's
    ~1.2 ms, and at a 152k vocabulary 20 ms against 75 ms (one thread); three constrained
    rows of 64 take 0.03 ms and 1.5 ms.
    """
    import xgrammar  # (a vocab mask exists only when a grammar was compiled: xgrammar is there)

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device, non_blocking=True), indices=rows)


def apply_vocab_mask_reference(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
    """The torch reference of apply_vocab_mask, on every row (a row of all ones changes nothing).

    Token t is bit (t % 32) of word t // 32, least significant first (xgrammar's layout).
    """
    bs, vocab_size = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    bits = (vocab_mask.to(logits.device)[:, :, None] >> shifts) & 1  # [bs, W, 32]
    allowed = bits.reshape(bs, -1)[:, :vocab_size].bool()  # [bs, V]
    logits.masked_fill_(~allowed, float("-inf"))
