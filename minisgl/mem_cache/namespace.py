"""Radix namespaces: a request's LoRA adapter and its own cache key folded into one `extra_key`.

Where it sits: the scheduler's `Req.extra_key` calls `namespace(lora_id, cache_key)`, and every
RadixCache match and insert for the request passes the result on (radix_cache.py: it is part of
every child key). The snapshot splits it back (`split_namespace`) to show the adapter and a tag
of the key (`key_tag`), never the key itself. In: the adapter's lora_id (the id of its load,
lora/lora_registry.py: its name, or NAME#k for a name loaded again; None: the base model) and
the request's key (/generate's `extra_key`, the OpenAI routes' `cache_salt + extra_key`; None:
none). Out: one string or None, SGLang's RadixKey.extra_key type.

Encoding, and why: SGLang concatenates (`(extra_key or "") + lora_id`), so key "a" with the base
model and key "" with adapter "a" share a namespace, and a client who picks a key equal to an
adapter's name reads that adapter's cached K/V. Here a request without a key keeps the plain
adapter name (the tree of a server that never sees a key is unchanged), and one with a key is
`lora_id + "\\0" + key`: adapter names, so lora_ids, hold no NUL (lora_registry.check_lora_name and
lora_config.parse_lora_paths refuse it), so the first NUL splits the string back into the pair,
and a keyed namespace (it has a NUL) never equals an unkeyed one (it has none). The map is one-to-one: two requests share cached K/V only
when both their adapter and their key are equal.
"""

from __future__ import annotations

import hashlib
import os
from typing import Optional, Tuple

SEPARATOR = "\0"  # between the adapter name (never holds one) and the request's key

# a per-process secret for key_tag: a tag shown in the visualizer cannot be checked against guessed
# salts offline (a bare hash of a short salt could), yet stays stable for the life of the server
_TAG_SECRET = os.urandom(16)


def namespace(lora_id: Optional[str], cache_key: Optional[str]) -> Optional[str]:
    """The radix tree's extra_key for a request: its adapter name alone without a key (None for the
    base model), else adapter + NUL + key. "" as a key is no key, as SGLang's `if value:`."""
    if not cache_key:
        return lora_id
    return (lora_id or "") + SEPARATOR + cache_key


def split_namespace(extra_key: Optional[str]) -> Tuple[Optional[str], Optional[str]]:
    """The inverse of namespace: (lora_id, cache_key)."""
    if extra_key is None or SEPARATOR not in extra_key:
        return extra_key, None
    lora_id, _, cache_key = extra_key.partition(SEPARATOR)
    return lora_id or None, cache_key


def key_tag(cache_key: Optional[str]) -> Optional[str]:
    """16 hex digits naming a request's cache key in snapshots: equal keys, equal tags (a reader sees
    which requests and nodes share a namespace), the key itself never shown (a tenant's cache salt
    is a secret of sorts: a page that showed it would let one tenant read another's cache)."""
    if cache_key is None:
        return None
    return hashlib.blake2b(cache_key.encode("utf-8", "surrogatepass"), digest_size=8, key=_TAG_SECRET).hexdigest()
