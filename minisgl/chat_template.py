"""Chat templates: the Jinja text /v1/chat/completions renders messages with, read and parsed.

Where it sits: ServerArgs checks `--chat-template` at start (`read_chat_template`); the HTTP
process puts the file on its tokenizer (`load_chat_template`) before serving; OpenAIServingChat
asks `template_variables` which names a template reads, to refuse `chat_template_kwargs` or
`reasoning_effort` that the template would drop (an unused `name` is found by rendering without it). transformers renders; this module only parses,
with the Jinja extensions transformers renders with, so what parses here renders there.
"""

from __future__ import annotations

import functools
import os
from typing import Any, FrozenSet, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2 import meta


class _GenerationBlock(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens), for
    parsing only: the block renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _environment() -> jinja2.Environment:
    # transformers renders with loopcontrols ({% break %}) and its {% generation %} block
    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationBlock])


def template_variables(template: Any) -> Optional[FrozenSet[str]]:
    """The variables a Jinja chat template reads from its context (the names chat_template_kwargs
    may set), or None when this Jinja cannot parse it (an extension transformers adds)."""
    if isinstance(template, dict):  # named templates: the default one renders chat
        template = template.get("default")
    return _variables_read_by(template) if isinstance(template, str) else None


@functools.lru_cache(maxsize=8)
def _variables_read_by(source: str) -> Optional[FrozenSet[str]]:
    try:  # (find_undeclared_variables compiles too: an unknown filter fails there)
        return frozenset(meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateError:  # the render says what is wrong, as a 400
        return None


def read_chat_template(path: str) -> str:
    """--chat-template: the text of a Jinja file, its syntax checked (ServerArgs reads it once at
    start, so a typo fails the start, not every chat request). SGLang also takes the name of a
    template it registers, or a JSON conversation template; minisgl ships neither."""
    if path.endswith(".json"):
        raise ValueError(
            f"--chat-template {path}: JSON conversation templates (SGLang's) are not supported; pass a Jinja template file"
        )
    if not os.path.isfile(path):
        raise ValueError(
            f"--chat-template {path}: no such file; pass a Jinja template file (SGLang's named templates are not built in)"
        )
    with open(path, encoding="utf-8") as f:
        template = f.read()
    try:
        _environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template {path}: line {e.lineno}: {e.message}") from e
    return template


def load_chat_template(tokenizer: Any, path: str) -> None:
    """Make the Jinja template in `path` the tokenizer's chat template (/v1/chat/completions renders with it)."""
    tokenizer.chat_template = read_chat_template(path)
