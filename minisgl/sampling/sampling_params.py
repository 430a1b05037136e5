"""SamplingParams: how one request samples and when it stops.

Where it sits: the OpenAI layer maps request fields onto these SGLang keys
(`to_sampling_params`), the TokenizerManager builds a SamplingParams from the dict
(`from_dict`: known keys, JSON types), calls `normalize(tokenizer)` and `verify(vocab_size)`
(ranges), and sends it inside
TokenizedGenerateReqInput to the Scheduler, where it lives on `Req.sampling_params`.
The sampler reads the numeric knobs; `Req.check_finished` reads the stop conditions.

Defaults are SGLang's native-API defaults (sglang-facts.md §10.3): max_new_tokens 128,
temperature 1.0, top_p 1.0, top_k -1 (all), min_p 0, penalties 0 / 0 / 1.0.
Greedy: a temperature below 1e-6 becomes temperature 1.0 with top_k 1, as in SGLang.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple, Union

from minisgl.sampling.stop_regex import compile_stop_regex, stop_regex_window
from minisgl.utils import ParamError, lone_surrogate_at

TOP_K_ALL = 1 << 30
_GREEDY_EPS = 1e-6


FLOAT32_MAX = 3.4028234663852886e38
MAX_N = 128  # samples per prompt: each is a whole request, and one client must not fill the server
MAX_TOP_LOGPROBS_NUM = 20  # OpenAI's bound on top_logprobs; the server holds /generate to it too
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value, [-100, 100]: -100 bans a token, 100 forces it
# the keys that constrain the output to a grammar (structured output; at most one per request)
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")
# the knobs a model's generation_config.json may set (SGLang's get_default_sampling_params)
GENERATION_CONFIG_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class SamplingParams:
    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, List[str]]] = None
    # regular expressions searched in the output like stop strings (stop_regex.py)
    stop_regex: Optional[Union[str, List[str]]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: Optional[int] = None
    n: int = 1
    stream_interval: Optional[int] = None
    # token id (a decimal string, as JSON object keys are) -> added to its logit before sampling
    logit_bias: Optional[Dict[str, float]] = None
    # structured output (constrained/xgrammar_backend.py): the output must match a JSON schema
    # (its JSON text), a regular expression or an EBNF grammar (GBNF-style, xgrammar's dialect)
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    # free text in which the text after a trigger must be one of the tagged structures (the JSON
    # text of SGLang's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers"},
    # or xgrammar's {"type": "structural_tag", "format": {...}})
    structural_tag: Optional[str] = None
    # the parameters of the request's custom logit processor (sampling/custom_logit_processor.py),
    # a JSON object it reads per row; only with a processor (tokenization.check_custom_logit_processor)
    custom_params: Optional[Dict[str, Any]] = None
    # filled by normalize(): stop strings and stop regexes as lists, and how many output tokens
    # hold their longest match (stop_regex.WHOLE_OUTPUT: all of them)
    stop_strs: List[str] = field(default_factory=list)
    stop_str_max_len: int = 0
    stop_regex_strs: List[str] = field(default_factory=list)
    stop_regex_max_len: int = 0

    KEYS = (
        "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "stop", "stop_regex", "stop_token_ids",
        "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
        "seed", "n", "stream_interval", "logit_bias", "json_schema", "regex", "ebnf", "structural_tag",
        "custom_params",
    )  # fmt: skip

    @classmethod
    def from_dict(cls, d: Optional[Dict[str, Any]]) -> "SamplingParams":
        """Build from SGLang's sampling_params dict; an unknown key or a wrong type is an error.

        This is where user input (the native /generate body, Engine.generate) becomes
        SamplingParams, so the types are checked here, before anything reaches the
        scheduler: a float max_new_tokens or a string seed would otherwise crash it.
        """
        if d is not None and not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object (a dict), got {type(d).__name__}")
        d = dict(d or {})
        if "sampling_seed" in d:  # SGLang's native name for the seed (its OpenAI layer maps seed to it)
            seed = d.pop("sampling_seed")
            if d.get("seed") is not None and seed is not None and d["seed"] != seed:
                raise ValueError(f"sampling_seed ({seed!r}) and seed ({d['seed']!r}) name the same seed: give one")
            if seed is not None:
                d["seed"] = seed
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"Unknown sampling parameter(s) {unknown}; supported: {list(cls.KEYS)}")
        for key, value in d.items():
            check_type(key, value)
        return cls(**d)

    def normalize(self, tokenizer: Any = None) -> None:
        """Canonical form: greedy mapping, top_k -1 -> all, stop as a list, stop-string token length."""
        if self.temperature is not None and 0 <= self.temperature < _GREEDY_EPS:
            self.temperature = 1.0
            self.top_k = 1
        if self.top_k == -1:
            self.top_k = TOP_K_ALL
        if isinstance(self.stop, str):
            self.stop_strs = [self.stop]
        elif self.stop:
            self.stop_strs = list(self.stop)
        if isinstance(self.stop_regex, str):
            self.stop_regex_strs = [self.stop_regex]
        elif self.stop_regex:
            self.stop_regex_strs = list(self.stop_regex)
        # (a pattern stop_regex_window cannot size is searched in the whole output; verify()
        # refuses one that does not compile)
        self.stop_regex_max_len = max((stop_regex_window(p) for p in self.stop_regex_strs), default=0)
        if self.stop_token_ids is not None:
            self.stop_token_ids = sorted(set(int(t) for t in self.stop_token_ids))
        if self.logit_bias is not None:
            # one spelling per id ("07" and 7 are token 7), as a JSON message will carry it
            self.logit_bias = {str(int(k)): float(v) for k, v in self.logit_bias.items()} or None
        # How many output tokens the scheduler decodes to look for a stop string. SGLang takes
        # the stop's own tokenization, but a model may spell it with more, smaller tokens (one
        # byte each at worst): its UTF-8 length bounds every spelling of a byte-level vocabulary.
        self.stop_str_max_len = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0)
        if self.stop_strs and tokenizer is not None:
            encoded = max(len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stop_strs)
            self.stop_str_max_len = max(self.stop_str_max_len, encoded)

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ParamError (a ValueError) naming the field and its valid range (sglang-facts.md §10.3)."""
        # NaN and inf fail too, and so does a value past float32's largest: it is inf on the logits
        # (and -inf / inf is NaN in a masked row)
        if self.temperature is None or not 0 <= self.temperature <= FLOAT32_MAX:
            raise ParamError(f"temperature must be a finite number >= 0 (at most {FLOAT32_MAX:.4g}), got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not 0 <= self.min_p <= 1:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if self.top_k < 1 and self.top_k != -1:
            raise ParamError(f"top_k must be -1 (all) or >= 1, got {self.top_k}", "top_k")
        if not -2 <= self.frequency_penalty <= 2:
            raise ParamError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        if not -2 <= self.presence_penalty <= 2:
            raise ParamError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        if not 0 < self.repetition_penalty <= 2:
            raise ParamError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}", "repetition_penalty")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ParamError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}", "max_new_tokens")
        if self.min_new_tokens < 0:
            raise ParamError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}", "min_new_tokens")
        if self.max_new_tokens is not None and self.min_new_tokens > self.max_new_tokens:
            raise ParamError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens ({self.max_new_tokens})", "min_new_tokens")
        if not 1 <= self.n <= MAX_N:  # the OpenAI routes' bound, for /generate too (the Engine fans n out itself)
            raise ParamError(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ParamError(f"stream_interval must be >= 1, got {self.stream_interval}", "stream_interval")
        if vocab_size is not None and self.stop_token_ids:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ParamError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
        if self.logit_bias:
            # a bias past OpenAI's range would only push a logit toward float32's overflow (inf/inf is NaN)
            bad_values = {k: v for k, v in self.logit_bias.items() if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
            if bad_values:
                raise ParamError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bad_values}", "logit_bias")
            if vocab_size is not None:
                bad = sorted(int(k) for k in self.logit_bias if not 0 <= int(k) < vocab_size)
                if bad:
                    raise ParamError(f"logit_bias token ids {bad} are outside the vocabulary [0, {vocab_size})", "logit_bias")
        for pattern in self.stop_regex_strs or _as_list(self.stop_regex) or []:
            compile_stop_regex(pattern)  # (ValueError: not a regex, or one that matches the empty string)
        grammars = [key for key in GRAMMAR_KEYS if getattr(self, key) is not None]
        if len(grammars) > 1:
            raise ValueError(f"Only one of regex, json_schema, ebnf, or structural_tag can be set, got {grammars}")
        for key, what in (("json_schema", "a JSON schema"), ("structural_tag", "a structural tag (an object)")):
            text = getattr(self, key)
            if text is None:
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as e:
                raise ParamError(f"{key} must be the JSON text of {what}: {e}", key) from None
            except RecursionError:  # ("[" * 100000: json's parser recurses once per level)
                raise ParamError(f"{key} is nested too deeply to parse", key) from None
            if key == "structural_tag" and not isinstance(value, dict):
                raise ParamError(f"structural_tag must be the JSON text of an object, got {type(value).__name__}", "structural_tag")

    @property
    def grammar_key(self) -> Optional[Tuple[str, str]]:
        """(type, text) of the grammar the output must match (SGLang's grammar cache key), or None."""
        for key in GRAMMAR_KEYS:
            text = getattr(self, key)
            if text is not None:
                return key, text
        return None

    def logit_bias_tensors(self, device: Any) -> Tuple[Any, Any]:
        """(token ids, biases) of logit_bias as tensors on `device`, built once per request.

        A batch's bias rows are rebuilt at every step (SamplingBatchInfo.from_reqs); parsing 1,024
        ids there again per request per step slowed every other client's steps by a third. Kept
        outside the dataclass fields, so it never crosses a process boundary.
        """
        import torch

        cached = self.__dict__.get("_logit_bias_tensors")
        if cached is None or cached[0] != str(device):  # (keyed as given: torch.device("cuda") != "cuda:0")
            items = (self.logit_bias or {}).items()
            ids = torch.tensor([int(k) for k, _ in items], dtype=torch.int64, device=device)
            values = torch.tensor([float(v) for _, v in items], dtype=torch.float32, device=device)
            cached = self.__dict__["_logit_bias_tensors"] = (str(device), ids, values)
        return cached[1], cached[2]

    def copy(self) -> "SamplingParams":
        return dataclasses.replace(self, stop_strs=list(self.stop_strs), stop_regex_strs=list(self.stop_regex_strs))

    @property
    def stop_tail_len(self) -> int:
        """How many of the last output tokens the scheduler decodes to look for a stop string or regex."""
        return max(self.stop_str_max_len, self.stop_regex_max_len)


# The JSON type of each key. JSON has one number type, so a float field takes an int;
# bool is a subclass of int in Python, so it is refused wherever a number is expected.
_INT_KEYS = frozenset({"min_new_tokens", "top_k", "n"})
_OPTIONAL_INT_KEYS = frozenset({"max_new_tokens", "seed", "stream_interval"})
_FLOAT_KEYS = frozenset({"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"})
_BOOL_KEYS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})


def _as_list(value: Any) -> Any:
    """A str as a one-element list; anything else as it is."""
    return [value] if isinstance(value, str) else value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_type(key: str, value: Any) -> None:
    """Raise ValueError naming `key` unless `value` has the JSON type SGLang's key takes."""
    got = f"got {value!r} ({type(value).__name__})"
    if key in _INT_KEYS and not _is_int(value):
        raise ValueError(f"{key} must be an integer, {got}")
    if key in _OPTIONAL_INT_KEYS and value is not None and not _is_int(value):
        raise ValueError(f"{key} must be an integer or null, {got}")
    if key in _FLOAT_KEYS and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise ValueError(f"{key} must be a number, {got}")
    if key in _BOOL_KEYS and not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, {got}")
    if key == "stop" and value is not None:
        strs = [value] if isinstance(value, str) else value
        if not isinstance(strs, list) or not all(isinstance(s, str) for s in strs):
            raise ValueError(f"stop must be a string or a list of strings, {got}")
        if any(s == "" for s in strs):
            raise ValueError("stop strings must not be empty: an empty string would match before the first token")
        for s in strs:
            if lone_surrogate_at(s) is not None:  # (JSON "\\ud800"): no tokenizer can encode it
                raise ValueError(f"stop strings must be valid Unicode, got {s!r} (a lone surrogate)")
    if key == "stop_regex" and value is not None:
        patterns = _as_list(value)
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise ValueError(f"stop_regex must be a string or a list of strings (regular expressions), {got}")
        for p in patterns:
            if lone_surrogate_at(p) is not None:
                raise ValueError(f"stop_regex patterns must be valid Unicode, got {p!r} (a lone surrogate)")
    if key in GRAMMAR_KEYS and value is not None and not isinstance(value, str):
        hint = " (its JSON text: json.dumps(schema))" if key == "json_schema" else ""
        raise ValueError(f"{key} must be a string{hint}, {got}")
    if key == "stop_token_ids" and value is not None:
        if not isinstance(value, list) or not all(_is_int(t) for t in value):
            raise ValueError(f"stop_token_ids must be a list of integers, {got}")
    if key == "custom_params" and value is not None:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"custom_params must be an object (a dict with string keys), {got}")
        if "__req__" in value:
            raise ValueError('custom_params must not name "__req__": the scheduler puts the request there')
        try:  # (what crosses to the scheduler is JSON: the Engine takes only what the server could)
            json.dumps(value)
        except (TypeError, ValueError, RecursionError) as e:
            raise ValueError(f"custom_params must be JSON (numbers, strings, lists, objects): {e}") from None
    if key == "logit_bias" and value is not None:
        if not isinstance(value, dict):
            raise ValueError(f'logit_bias must be an object mapping token ids to numbers, e.g. {{"42": -100}}, {got}')
        for token, bias in value.items():
            if not (_is_int(token) or (isinstance(token, str) and _is_decimal(token))):
                raise ValueError(f"logit_bias keys must be token ids (integers, or decimal strings in JSON), got {token!r}")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool)):
                raise ValueError(f"logit_bias values must be numbers, got {bias!r} for token {token!r}")


def _is_decimal(text: str) -> bool:
    """A JSON object key naming a token id: ASCII digits, optionally signed ("-1" is refused later as out of vocabulary)."""
    digits = text[1:] if text[:1] in "+-" else text
    return digits.isascii() and digits.isdigit()


def stop_token_set(params: SamplingParams, eos_token_ids: Set[int]) -> Set[int]:
    """Token ids that finish a request: stop_token_ids and EOS.

    As in SGLang, `ignore_eos` skips the token-based check entirely (stop_token_ids too);
    stop strings and max_new_tokens still apply.
    """
    if params.ignore_eos:
        return set()
    return set(params.stop_token_ids or ()) | set(eos_token_ids)
