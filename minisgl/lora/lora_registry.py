"""LoRARegistry: the adapters a request may name, and a unique `lora_id` per load (SGLang's).

Where it sits: the TokenizerManager (server) and the Engine (in-process) each hold one. A
request's `lora_path` (an adapter's name) is looked up here and becomes its `lora_id`, which is
what crosses to the Scheduler (`TokenizedGenerateReqInput.lora_id`, `Req.lora_id`), keys the
adapter's weights in the ModelRunner's LoRAManager, and names the adapter's radix namespace
(`Req.extra_key`). /v1/models lists what is registered. No torch and no I/O here.

A load or an unload is one sequence, the same for the TokenizerManager and the Engine, written
once here as two context managers (`loading`, `unloading`); the caller only sends the message
and waits its own way (an await, or scheduler steps):

    load:   check the name -> mint an id -> [caller: the scheduler reads the weights] -> register
            the name and commit the id, only if the scheduler answered success
    unload: unregister the name (new requests naming it are refused) -> [caller: wait for the
            adapter's requests in flight, then the scheduler drops the weights] -> when the
            unload failed or was interrupted and the weights are still loaded, register the
            name again, so it is never left without its weights or the weights without their name

Why an id per load and not the name: an adapter unloaded and loaded again under the same name
may have other weights, and the radix tree still holds K/V computed with the old ones under the
old namespace. A new id is a new namespace, so the old K/V is never reused (it stays evictable
like any cache nobody uses). SGLang mints `uuid4().hex` per load; minisgl mints a readable id
that is as unique (`LoRARegistry.next_lora_id`): the name itself the first time a name is loaded,
then `NAME#2`, `NAME#3`, ...; a name that holds a `#` always carries its number (`x#y#1`), so
no two (name, load) pairs give one id and `lora_name_of` reads the name back. The adapters of
--lora-paths are loaded first, once each: the HTTP process (this registry) and the scheduler
process (LoRAManager) derive their ids alike, with nothing sent between them (SGLang derives a
deterministic id for them too).

`LoRAInFlight` counts the TokenizerManager's requests per lora_id (SGLang's per-adapter
ConcurrentCounter): an unload waits for zero before it sends anything to the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Tuple, Union

from minisgl.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput, UnloadLoRAAdapterReqInput

# The one answer to a LoRA call on a server or an Engine without LoRA: a request's lora_path, a
# load, an unload (the TokenizerManager, the Engine, the Scheduler).
LORA_NOT_ENABLED = (
    "LoRA is not enabled: start the server with --lora-paths NAME=PATH ..., or with --enable-lora --max-lora-rank R "
    "--lora-target-modules M ... to load adapters while serving (the Engine: lora_paths=[...], or enable_lora=True "
    "with max_lora_rank and lora_target_modules)"
)
# A loaded adapter's name rides in every /v1/models answer and log line of its requests, and is
# typed by clients as "BASE:NAME": a clear bound, as MAX_EXTRA_KEY_CHARS is for cache keys.
MAX_LORA_NAME_CHARS = 256


@dataclass(frozen=True)
class LoRARef:
    """One loaded adapter (SGLang's LoRARef): its id for this load, its name and its directory.
    `pinned`: the load asked to keep it resident (minisgl keeps every adapter resident: see
    docs/model_execution.md, "Loading and unloading while serving")."""

    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


def check_lora_name(name: object, where: str = "lora_name") -> str:
    """An adapter's name: a non-empty string without NUL (mem_cache/namespace.py: the NUL separates
    an adapter from a request's cache key in the radix namespace). Returns it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where} must be a non-empty string (the adapter's name), got {name!r}")
    if "\0" in name:
        raise ValueError(f"{where} {name!r} holds a NUL character; name the adapter without one")
    return name


def check_lora_load_args(lora_name: object, lora_path: object, pinned: object) -> None:
    """A load's own fields (/load_lora_adapter's body, Engine.load_lora_adapter's arguments): one
    check for both, before anything waits or reaches the scheduler. ValueError says what to change."""
    name = check_lora_name(lora_name)
    if len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"lora_name takes at most {MAX_LORA_NAME_CHARS} characters, got {len(name)}: name the adapter shorter")
    if name != name.strip():  # (the OpenAI routes strip "BASE: NAME "'s adapter: it could never be named)
        raise ValueError(f"lora_name {name!r} starts or ends with whitespace; name the adapter without it")
    if not isinstance(lora_path, str) or not lora_path:
        raise ValueError(f"lora_path must be the adapter's directory (a PEFT save_pretrained directory), got {lora_path!r}")
    if not isinstance(pinned, bool):
        raise ValueError(f"pinned must be True or False, got {pinned!r}")


def lora_name_of(lora_id: str) -> str:
    """The adapter name a lora_id was minted for (LoRARegistry.next_lora_id's inverse)."""
    return lora_id.rsplit("#", 1)[0] if "#" in lora_id else lora_id


def lora_not_loaded(name: str, loaded: Iterable[str]) -> str:
    """The error of a request (or an unload) naming an adapter that is not loaded (the
    TokenizerManager's, the Engine's and the Scheduler's: one wording)."""
    names = sorted(loaded)
    listed = f"the loaded adapters are: {', '.join(names)}" if names else "no adapter is loaded"
    return f"LoRA adapter {name!r} is not loaded; {listed}"


@dataclass
class LoRAUpdate:
    """One load or unload under way: the message for the scheduler, and its answer once the caller
    has it (None: no answer came, e.g. the wait was interrupted before anything was sent)."""

    msg: Union[LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput]
    out: Optional[LoRAUpdateOutput] = None


class LoRARegistry:
    """Name -> LoRARef of the adapters loaded now, in load order; and how often each name loaded."""

    def __init__(self, adapters: Iterable[Tuple[str, str]] = ()) -> None:
        self._registry: Dict[str, LoRARef] = {}
        # name -> its successful loads so far: the next load's id (only grows, so an id is never
        # given to two loads; a failed load commits nothing, so its id is the next one's)
        self._loads: Dict[str, int] = {}
        for name, path in adapters:  # --lora-paths: loaded first, so each id is its name
            self._register(LoRARef(self.next_lora_id(check_lora_name(name)), name, path))

    def next_lora_id(self, name: str) -> str:
        """The id the next load of `name` gets: `name` the first time, then `name#k` for the k-th
        load; a name holding `#` always takes its number, so ids of two names never meet."""
        k = self._loads.get(name, 0) + 1
        return name if k == 1 and "#" not in name else f"{name}#{k}"

    def check_new_name(self, name: str, max_loaded_loras: Optional[int]) -> None:
        """Whether adapter `name` may be loaded now: a free name, under --max-loaded-loras
        (SGLang's refusal, with the flag to raise). ValueError otherwise."""
        if name in self._registry:
            raise ValueError(
                f"LoRA adapter {name!r} is already loaded (from {self._registry[name].lora_path!r}); "
                "unload it first (/unload_lora_adapter), or load the new one under another name"
            )
        if max_loaded_loras is not None and len(self._registry) >= max_loaded_loras:
            raise ValueError(
                f"Cannot load LoRA adapter {name!r}: the maximum number of loaded LoRA adapters is "
                f"{max_loaded_loras} (--max-loaded-loras), loaded: {', '.join(self._registry)}. Unload one first "
                "(/unload_lora_adapter), or restart the server with a higher --max-loaded-loras"
            )

    # ------------------------------------------------------------------ the two sequences
    @contextlib.contextmanager
    def loading(self, name: str, path: str, pinned: bool, max_loaded_loras: Optional[int]) -> Iterator[LoRAUpdate]:
        """`with registry.loading(...) as update: update.out = <the scheduler's answer to update.msg>`.
        Checks first (ValueError: nothing sent); registers the name, and commits its id, only when
        the answer is a success, even if the body then raises (the weights are loaded by then).
        The caller holds its lock: loads and unloads take turns."""
        check_lora_load_args(name, path, pinned)
        self.check_new_name(name, max_loaded_loras)
        ref = LoRARef(self.next_lora_id(name), name, path, pinned)
        update = LoRAUpdate(LoadLoRAAdapterReqInput(name, path, pinned, ref.lora_id))
        try:
            yield update
        finally:
            if update.out is not None and update.out.success:
                self._register(ref)

    @contextlib.contextmanager
    def unloading(self, name: str) -> Iterator[LoRAUpdate]:
        """`with registry.unloading(name) as update: <wait for its requests>; update.out = <the
        scheduler's answer to update.msg>`. The name is unregistered on entry (ValueError when it
        is not a name, or not loaded). On exit, an unload that failed with the weights still
        loaded, or that got no answer (update.out still None: an exception or a Ctrl-C ended the
        wait), registers the name again in its place, so the adapter stays usable and can be
        unloaded later. With no answer the weights may still be loaded, and are assumed to be:
        true for the Engine (signals are held from the handover to the answer, so an interruption
        comes before the scheduler sees the unload) and for the TokenizerManager's wait for the
        adapter's requests. The one case where it may be wrong: the TokenizerManager's event loop
        shut down after the unload was sent (asyncio.shield keeps clients out), when the scheduler
        may drop the weights of a name registered again, in a server that is going away."""
        check_lora_name(name)  # (a list is a ValueError saying so, not an unhashable key)
        ref = self._registry.get(name)
        if ref is None:
            raise ValueError(lora_not_loaded(name, self._registry))
        order = list(self._registry)
        del self._registry[name]
        update = LoRAUpdate(UnloadLoRAAdapterReqInput(name, ref.lora_id))
        try:
            yield update
        finally:
            out = update.out
            if out is None or (not out.success and out.loaded_adapters.get(name) == ref.lora_path):
                self._registry[name] = ref
                self._registry = {n: self._registry[n] for n in order if n in self._registry}  # (its place back)

    def _register(self, ref: LoRARef) -> None:
        assert ref.lora_name not in self._registry, ref  # (check_new_name ran under the same lock)
        self._registry[ref.lora_name] = ref
        self._loads[ref.lora_name] = self._loads.get(ref.lora_name, 0) + 1

    # ------------------------------------------------------------------ lookups
    def lora_id_of(self, name: str) -> str:
        """The id a request naming adapter `name` runs with; ValueError when it is not loaded."""
        ref = self._registry.get(name)
        if ref is None:
            raise ValueError(lora_not_loaded(name, self._registry))
        return ref.lora_id

    def refs(self) -> List[LoRARef]:
        """The loaded adapters, in load order."""
        return list(self._registry.values())

    def loaded_adapters(self) -> Dict[str, str]:
        """Name -> directory of each loaded adapter (LoRAUpdateOutput.loaded_adapters)."""
        return {ref.lora_name: ref.lora_path for ref in self._registry.values()}

    def __len__(self) -> int:
        return len(self._registry)


class LoRAInFlight:
    """The TokenizerManager's requests in flight per lora_id (SGLang's ConcurrentCounter per adapter):
    `acquire` where a ReqState with a lora_id is created, `release` wherever one is deleted, and
    `wait_for_zero`, an unload's wait, returns once none is left. An id at zero has no entry (no
    leak per load). A name is unregistered before its unload waits, so the count of an id being
    waited for only falls (a warm-up of a request already counted may still add one meanwhile)."""

    def __init__(self) -> None:
        self._counts: Dict[str, int] = {}
        self._zero: Dict[str, asyncio.Event] = {}  # lora_id -> the event an unload waits on

    def acquire(self, lora_id: str) -> None:
        self._counts[lora_id] = self._counts.get(lora_id, 0) + 1

    def release(self, lora_id: str) -> None:
        left = self._counts[lora_id] - 1
        if left:
            self._counts[lora_id] = left
            return
        del self._counts[lora_id]
        event = self._zero.pop(lora_id, None)
        if event is not None:
            event.set()

    def count(self, lora_id: str) -> int:
        return self._counts.get(lora_id, 0)

    async def wait_for_zero(self, lora_id: str) -> None:
        if lora_id in self._counts:
            await self._zero.setdefault(lora_id, asyncio.Event()).wait()
