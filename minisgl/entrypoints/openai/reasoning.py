"""Reasoning parser (stage 1, chat only): a thinking model's `<think>...</think>` as
`reasoning_content`, apart from the answer's `content` (SGLang's --reasoning-parser).

Where it sits: OpenAIServingChat runs each choice's text through a `ReasoningSplitter` before
anything else reads it (the tool-call parser sees only the answer). Non-streaming, the whole
text goes through at once; streamed, each delta does, and the splitter holds back what the
next delta may still change (a tail that could be the start of `</think>`, whitespace that may
end the reasoning), so a stream's pieces add up to exactly the non-streaming answer.

The parsers, SGLang's two families:
- `qwen3`: Qwen3 starts its answer with `<think>` when it thinks (and not at all with
  `enable_thinking: false`): reasoning only when the output begins with the start tag.
- `deepseek-r1`: DeepSeek-R1's template opens the `<think>` itself, so the output starts inside
  the reasoning (a `<think>` it writes anyway is dropped); everything before `</think>` is
  reasoning, all of it when the answer is cut off before the tag.
Reasoning is stripped of the whitespace around it, the answer of the whitespace that starts it
(the model's "\\n\\n" after `</think>`); the tags themselves appear in neither.
"""

from __future__ import annotations

from typing import Tuple

from minisgl.constrained.reasoner_grammar import REASONING_TAGS


class ReasoningSplitter:
    """One choice's text -> (reasoning, content) deltas; feed() each piece, then finish()."""

    def __init__(self, parser: str, continues: str = "") -> None:
        """`continues`: the assistant text a continue_final_message request's output goes on from;
        one that opened the start tag without closing it puts the output inside the reasoning."""
        self.start, self.end, self.forced = REASONING_TAGS[parser]
        self.mode = "opening"  # -> "reasoning" -> "closing" (whitespace after the end tag) -> "content"
        self.held = ""  # text not yet given out: it may still change what it is
        self.reasoning_started = False  # (the reasoning's leading whitespace is dropped)
        if continues.rfind(self.start) > continues.rfind(self.end):
            self.mode, self.reasoning_started = "reasoning", True  # (its start is the user's text: kept as it comes)
        elif self.end in continues:
            self.mode = "content"  # (the thinking is over already)

    def feed(self, delta: str) -> Tuple[str, str]:
        """(reasoning, content) that `delta`, with what was held back, makes certain."""
        text, self.held = self.held + delta, ""
        reasoning = content = ""
        if self.mode == "opening":
            body = text.lstrip()
            if body.startswith(self.start):
                self.mode, text = "reasoning", body[len(self.start) :]
            elif self.start.startswith(body):  # (empty, blanks, or a piece of the start tag: undecided)
                self.held = text
                return "", ""
            else:
                self.mode = "reasoning" if self.forced else "content"
        if self.mode == "reasoning":
            if not self.reasoning_started:
                text = text.lstrip()
            pos = text.find(self.end)
            if pos < 0:
                # hold a tail that may begin the end tag, and trailing blanks that may end the reasoning
                keep = _longest_tag_prefix_suffix(text, self.end)
                sure = text[: len(text) - keep].rstrip()
                self.held = text[len(sure) :]
                self.reasoning_started |= bool(sure)
                return sure, ""
            reasoning = text[:pos].rstrip()
            self.mode, text = "closing", text[pos + len(self.end) :]
        if self.mode == "closing":
            text = text.lstrip()
            if not text:
                return reasoning, ""
            self.mode = "content"
        content = text
        return reasoning, content

    def finish(self) -> Tuple[str, str]:
        """(reasoning, content) still held when the choice ends."""
        held, self.held = self.held, ""
        if self.mode == "opening":  # (only blanks or a piece of the start tag came)
            return (held.strip(), "") if self.forced else ("", held)
        if self.mode == "reasoning":  # cut off before the end tag: all of it was reasoning
            return held.rstrip() if self.reasoning_started else held.strip(), ""
        return "", held


def split_reasoning(parser: str, text: str, continues: str = "") -> Tuple[str, str]:
    """A whole answer -> (reasoning, content): the splitter, fed all of it at once."""
    splitter = ReasoningSplitter(parser, continues)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return reasoning + more_reasoning, content + more_content


def _longest_tag_prefix_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0
