"""A grammar that holds only after the model's thinking (stage 3, inside the Scheduler):
SGLang's ReasonerGrammarObject.

Where it sits: a chat request to a server with --reasoning-parser carries `require_reasoning`
(the model writes `<think>...</think>` before its answer); when its grammar has compiled, the
Scheduler wraps it here. Until the output ends with the think-end tokens every token is allowed
and none is fed to the grammar; from there on the wrapped grammar decides, as if the answer
began there. Without it, a forced tool call or a json_schema held from the first token: a
thinking model could never write `</think>`, and the reasoning parser put the whole
constrained answer in reasoning_content.
"""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

# --reasoning-parser -> (start tag, end tag, whether the output starts inside the reasoning):
# SGLang's two families (the chat route's splitter, entrypoints/openai/reasoning.py, reads it too)
REASONING_TAGS: Dict[str, Tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek-r1": ("<think>", "</think>", True),
}


class ReasonerGrammar:
    """`grammar` (an XGrammarGrammar), applied from the first token after `think_end_ids`."""

    def __init__(self, grammar: Any, think_end_ids: List[int]) -> None:
        if not think_end_ids:
            raise ValueError("the think-end text encodes to no tokens")
        self.grammar = grammar
        self.think_end_ids = list(think_end_ids)
        self.thinking = True
        self._recent: List[int] = []  # the last len(think_end_ids) tokens while thinking

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """While thinking, the row stays as allocated: every token allowed."""
        if not self.thinking:
            self.grammar.fill_vocab_mask(vocab_mask, idx)

    def accept_token(self, token: int) -> None:
        if not self.thinking:
            self.grammar.accept_token(token)
            return
        self._recent = (self._recent + [token])[-len(self.think_end_ids) :]
        if self._recent == self.think_end_ids:
            self.thinking = False

    def is_terminated(self) -> bool:
        return not self.thinking and self.grammar.is_terminated()
