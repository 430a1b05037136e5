"""NGRAMWorker: speculative decoding that guesses tokens from the request's own text
(--speculative-algorithm NGRAM; docs/scheduler.md, "Speculative decoding").

Where it sits: Scheduler.update_running_batch -> NGRAMWorker.propose (the drafts of each running
request) -> ScheduleBatch.prepare_for_verify -> run_batch (one TARGET_VERIFY forward: each
request's last sampled token and its drafts, every row sampled as a decode step would sample it)
-> process_batch_result_decode -> NGRAMWorker.accepted (how many drafts the samples confirm) ->
ScheduleBatch.release_unaccepted (the K/V written for the rest goes back).

A decode step reads every weight of the model to produce one token per request; at small batches
(on a CPU and a GPU alike) the step costs about the same for a few more tokens per request. When
the next tokens are predictable, a guess of k tokens checked in one pass gives up to k + 1
tokens for the price of one step. The guesses here come from the request itself: when its last
n tokens (n from --speculative-ngram-max-match-window-size down to the min) occurred earlier in
its prompt or output, the tokens that followed them there are the draft. Code edits, quoting,
summaries and the loops of small models repeat a lot; free text little.

Verification keeps the output exactly what decoding one token at a time would give. Row j of a
request is sampled from the model's distribution after its last token and drafts 1..j (greedy:
argmax; seeded: the same Gumbel noise of (seed, position) a decode step draws). Draft j+1 is
accepted when row j's sample equals it; the first row whose sample differs gives the request's
next token instead (the "bonus" token), and the rows after it are dropped. A draft token is a
fixed guess, so accepting it when the sample equals it is speculative sampling's rule for a
one-point draft distribution (accept with probability p(draft), else draw from p without the
draft): every output token is a sample of the model's distribution given the tokens before it.

SGLang's NGRAM keeps one n-gram trie for all requests and drafts a tree of candidates per request
(checked with a tree attention mask); minisgl drafts one chain per request from that request's
tokens, which an ordinary causal extend checks, and indexes the prompt too (prompt lookup).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence


class NgramIndex:
    """One request's tokens, and for each token id the positions where it occurred: enough to find
    the longest earlier match of the sequence's end without a table per n-gram length.

    A lookup walks back through the latest occurrences of the last token (at most
    MAX_CANDIDATES of them) and extends each match backwards, up to max_n tokens. Building it is one
    append per token (a 4,000-token prompt: about a millisecond; a table of every n-gram for n up
    to 12 took 0.3-0.8 s and 7 MB), and a lookup costs the same at any length."""

    MAX_CANDIDATES = 64  # (the latest occurrences are the likeliest to continue the same way)

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: List[int] = []
        self.positions: Dict[int, List[int]] = {}  # token id -> where it occurred, in order (but the last token)

    def extend(self, new_tokens: Sequence[int]) -> None:
        """Append tokens; the one that was last is now followed by something, so it is indexed."""
        for token in new_tokens:
            if self.tokens:
                self.positions.setdefault(self.tokens[-1], []).append(len(self.tokens) - 1)
            self.tokens.append(token)

    def propose(self, max_len: int) -> List[int]:
        """max_len tokens that followed the longest earlier occurrence of the sequence's last n tokens
        (min_n <= n <= max_n; of equally long ones, the latest), or [] when there is none.

        The continuation may run into the sequence's end (the occurrence is recent: a loop). The
        match then says the text repeats with period len(tokens) - start, and the draft goes on
        repeating it: "a b a b a" drafts "b a b a", not just "b"."""
        tokens, length = self.tokens, len(self.tokens)
        best_n, best_end = 0, -1
        for end in reversed(self.positions.get(tokens[-1], [])[-self.MAX_CANDIDATES :]):
            n = 1
            while n < self.max_n and n <= end and tokens[end - n] == tokens[length - 1 - n]:
                n += 1
            if n > best_n:
                best_n, best_end = n, end
                if n == self.max_n:
                    break
        if best_n < self.min_n:
            return []
        start = best_end + 1
        period = length - start
        draft = tokens[start : start + max_len]
        while len(draft) < max_len:
            draft.append(draft[len(draft) - period])
        return draft


class NGRAMWorker:
    """Drafts for the running batch, the count of drafts a verify pass accepted, and each request's
    record of how its drafts fare.

    A draft row costs a row of compute in the verify pass, whether it is accepted or not: text that
    does not repeat (sampled prose) keeps finding short matches whose continuations are wrong, and
    verifying them made such a batch 1.5x slower than plain decoding. So each request keeps a
    running hit rate (the share of its drafted tokens that were accepted, an exponential average
    over its verify passes, starting at HIT_RATE_START); below MIN_HIT_RATE it stops drafting, and
    tries again once every PROBE_INTERVAL passes, so a request whose text starts repeating later
    (a list, a quote) speculates again. The probes of all requests fall on the same passes: one
    request's draft makes the whole batch's pass a verify pass, which costs more than a decode step
    even for the rows without drafts, so probes spread over different passes kept most passes
    verifying."""

    HIT_RATE_START = 0.5
    HIT_RATE_DECAY = 0.5  # weight of the history: two failed drafts in a row stop a fresh request
    MIN_HIT_RATE = 0.2
    PROBE_INTERVAL = 16

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int, max_total_drafts: int) -> None:
        # SGLang's --speculative-num-draft-tokens counts the verified last token too: k guesses
        self.max_drafts = num_draft_tokens - 1
        self.min_window, self.max_window = min_window, max_window
        # a verify pass computes a logits row per token: its drafts are capped like a prefill chunk's tokens
        self.max_total_drafts = max_total_drafts
        self.num_passes = 0  # propose() calls: the decoding passes, which the probes count

    @staticmethod
    def can_speculate(req: Any) -> bool:
        """Whether a request's rows would be sampled as its decode steps would be. Not when what
        shapes a token depends on the tokens before it in a way a row cannot see: penalties count
        the output so far, min_new_tokens masks the stop tokens until enough were produced, a
        grammar advances with each token, a custom logit processor may keep state. Those requests
        decode one token per pass (a verify row with no drafts)."""
        p = req.sampling_params
        return not (
            req.grammar is not None
            or req.custom_logit_processor is not None
            or p.frequency_penalty != 0
            or p.presence_penalty != 0
            or p.repetition_penalty != 1
            or len(req.output_ids) < p.min_new_tokens
            or req.to_finish is not None  # (an abort is pending: the next token ends it)
        )

    def wants_to_draft(self, req: Any) -> bool:
        """A request whose drafts keep failing sits out, but for the probe pass (one in PROBE_INTERVAL)."""
        return req.spec_hit_rate >= self.MIN_HIT_RATE or self.num_passes % self.PROBE_INTERVAL == 0

    def propose(self, reqs: Sequence[Any]) -> List[List[int]]:
        """Each request's draft tokens ([] for one that cannot or need not speculate, or found no
        match). A draft never runs past max_new_tokens (the bonus token after it must fit too), and
        all of them together stay within max_total_drafts (in batch order)."""
        self.num_passes += 1
        drafts = []
        room = self.max_total_drafts
        for req in reqs:
            budget = min(self.max_drafts, req.sampling_params.max_new_tokens - len(req.output_ids) - 1, room)
            if budget <= 0 or not self.can_speculate(req) or not self.wants_to_draft(req):
                drafts.append([])
                continue
            index = req.ngram_index
            if index is None:
                index = req.ngram_index = NgramIndex(self.min_window, self.max_window)
                index.extend(req.origin_input_ids)
            index.extend(req.output_ids[len(index.tokens) - len(req.origin_input_ids) :])  # (the tokens since its last draft)
            drafts.append(index.propose(budget))
            room -= len(drafts[-1])
        return drafts

    @staticmethod
    def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
        """How many leading drafts the samples confirm: draft j+1 stands when row j sampled it.
        `sampled` has one more entry than `drafts` (the row after the last draft)."""
        n = 0
        while n < len(drafts) and sampled[n] == drafts[n]:
            n += 1
        return n

    def record(self, req: Any, num_drafts: int, num_accepted: int) -> None:
        """A verify pass's outcome for a request that drafted: its hit rate moves toward this pass's."""
        if num_drafts:
            req.spec_hit_rate = self.HIT_RATE_DECAY * req.spec_hit_rate + (1 - self.HIT_RATE_DECAY) * num_accepted / num_drafts
