"""A grammar that holds only after the model's thinking (stage 3, inside the Scheduler):
SGLang's ReasonerGrammarObject.

Where it sits: a chat request to a server with --reasoning-parser carries `require_reasoning`
(the model writes `<think>...</think>` before its answer); when its grammar has compiled, the
Scheduler wraps it here. Until the output's text ends with the think-end tag every token is allowed
and none is fed to the grammar; from there on the wrapped grammar decides, as if the answer
began there. Without it, a forced tool call or a json_schema held from the first token: a
thinking model could never write `</think>`, and the reasoning parser put the whole
constrained answer in reasoning_content.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Tuple

import torch

# --reasoning-parser -> (start tag, end tag, whether the output starts inside the reasoning):
# SGLang's two families (the chat route's splitter, entrypoints/openai/reasoning.py, reads it too)
REASONING_TAGS: Dict[str, Tuple[str, str, bool]] = {
    "qwen3": ("<think>", "</think>", False),
    "deepseek-r1": ("<think>", "</think>", True),
}


class ReasonerGrammar:
    """`grammar` (an XGrammarGrammar), applied from the first token after the output's text ends
    with `think_end`. The text, not the ids: where `</think>` is no single token, a model spells it
    in more than one way (" </think>" merges the space into its first token)."""

    def __init__(self, grammar: Any, think_end: str, decode: Callable[[List[int]], str]) -> None:
        if not think_end:
            raise ValueError("the think-end text is empty")
        self.grammar = grammar
        self.think_end = think_end
        self.decode = decode
        self.thinking = True
        # the last tokens while thinking: enough for the end tag spelled a byte per token, and one more
        self._window = len(think_end.encode()) + 1
        self._recent: List[int] = []

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """While thinking, the row stays as allocated: every token allowed."""
        if not self.thinking:
            self.grammar.fill_vocab_mask(vocab_mask, idx)

    def accept_token(self, token: int) -> None:
        if not self.thinking:
            self.grammar.accept_token(token)
            return
        self._recent = (self._recent + [token])[-self._window :]
        if self.decode(self._recent).endswith(self.think_end):
            self.thinking = False

    def is_terminated(self) -> bool:
        return not self.thinking and self.grammar.is_terminated()
