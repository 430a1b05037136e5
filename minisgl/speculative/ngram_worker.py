"""NGRAMWorker: speculative decoding that guesses tokens from the request's own text
(--speculative-algorithm NGRAM; docs/scheduler.md, "Speculative decoding").

Where it sits: Scheduler.update_running_batch -> NGRAMWorker.propose (the drafts of each running
request) -> ScheduleBatch.prepare_for_verify -> run_batch (one TARGET_VERIFY forward: each
request's last sampled token and its drafts, every row sampled as a decode step would sample it)
-> process_batch_result_decode -> NGRAMWorker.accepted (how many drafts the samples confirm) ->
ScheduleBatch.release_unaccepted (the K/V written for the rest goes back).

A decode step reads every weight of the model to produce one token per request; on a CPU (and
a GPU at small batches) the step costs about the same for a few more tokens per request. When
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

from typing import Any, Dict, List, Sequence, Tuple


class NgramIndex:
    """Where each n-gram of one request's tokens (n in [min_n, max_n]) last occurred: the index of
    the token that followed it. Kept up to date incrementally (each new token adds max_n - min_n + 1
    entries), so a lookup costs the same for a 10-token and a 10,000-token sequence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tables: Dict[int, Dict[Tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.num_indexed = 0  # n-grams ending before this position are in the tables

    def update(self, tokens: Sequence[int]) -> None:
        """Index the n-grams whose next token is known: those ending before the last token (the
        n-gram that ends at the last token is the one a lookup searches for)."""
        for end in range(self.num_indexed, len(tokens) - 1):
            for n, table in self.tables.items():
                if n > end + 1:
                    break
                # a later occurrence overwrites an earlier one: the most recent context wins
                table[tuple(tokens[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(tokens) - 1)

    def propose(self, tokens: Sequence[int], max_len: int) -> List[int]:
        """max_len tokens that followed the longest earlier occurrence of the sequence's last n
        tokens, or [] when no suffix of min_n tokens or more occurred before.

        The continuation may run into the sequence's end (the occurrence is recent: a loop). The
        match then says the text repeats with period len(tokens) - start, and the draft goes on
        repeating it: "a b a b a" drafts "b a b a", not just "b"."""
        self.update(tokens)
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            start = self.tables[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                period = len(tokens) - start
                draft = list(tokens[start : start + max_len])
                while len(draft) < max_len:
                    draft.append(draft[len(draft) - period])
                return draft
        return []


class NGRAMWorker:
    """Drafts for the running batch, and the count of drafts a verify pass accepted."""

    def __init__(self, num_draft_tokens: int, min_window: int, max_window: int) -> None:
        # SGLang's --speculative-num-draft-tokens counts the verified last token too: k guesses
        self.max_drafts = num_draft_tokens - 1
        self.min_window, self.max_window = min_window, max_window

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

    def propose(self, reqs: Sequence[Any]) -> List[List[int]]:
        """Each request's draft tokens ([] for one that cannot speculate or found no match). A draft
        never runs past max_new_tokens: the bonus token after it must fit too."""
        drafts = []
        for req in reqs:
            budget = min(self.max_drafts, req.sampling_params.max_new_tokens - len(req.output_ids) - 1)
            if budget <= 0 or not self.can_speculate(req):
                drafts.append([])
                continue
            if req.ngram_index is None:
                req.ngram_index = NgramIndex(self.min_window, self.max_window)
            drafts.append(req.ngram_index.propose(req.origin_input_ids + req.output_ids, budget))
        return drafts

    @staticmethod
    def accepted(drafts: Sequence[int], sampled: Sequence[int]) -> int:
        """How many leading drafts the samples confirm: draft j+1 stands when row j sampled it.
        `sampled` has one more entry than `drafts` (the row after the last draft)."""
        n = 0
        while n < len(drafts) and sampled[n] == drafts[n]:
            n += 1
        return n
