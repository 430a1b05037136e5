"""Structured output: grammars that constrain which tokens a request may sample (SGLang's srt/constrained)."""
