"""Speculative decoding: draft several next tokens cheaply, check them all in one forward (SGLang's srt/speculative)."""
