"""LoRARegistry: the adapters a request may name, and a unique `lora_id` per load (SGLang's).

Where it sits: the TokenizerManager (server) and the Engine (in-process) each hold one. A
request's `lora_path` (an adapter's name) is looked up here and becomes its `lora_id`, which is
what crosses to the Scheduler (`TokenizedGenerateReqInput.lora_id`, `Req.lora_id`), keys the
adapter's weights in the ModelRunner's LoRAManager, and names the adapter's radix namespace
(`Req.extra_key`). /load_lora_adapter mints a new ref here and registers it once the scheduler
has loaded the weights; /unload_lora_adapter unregisters the name first, so that no new request
can name it, and only then waits for its requests and unloads it. /v1/models lists what is
registered. No torch and no I/O here.

Why an id per load and not the name: an adapter unloaded and loaded again under the same name
may have other weights, and the radix tree still holds K/V computed with the old ones under the
old namespace. A new id is a new namespace, so the old K/V is never reused (it stays evictable
like any cache nobody uses). SGLang mints `uuid4().hex` per load; minisgl mints a readable id
that is as unique: the name itself the first time a name is loaded, then `NAME#2`, `NAME#3`, ...
(`mint_lora_id`). The adapters of --lora-paths are loaded first, once each, so their ids are
their names: the HTTP process (this registry) and the scheduler process (LoRAManager) derive
them alike, with nothing sent between them (SGLang derives a deterministic id for them too).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple


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


class LoRARegistry:
    """Name -> LoRARef of the adapters loaded now, in load order; and every lora_id ever minted."""

    def __init__(self, adapters: Iterable[Tuple[str, str]] = ()) -> None:
        self._registry: Dict[str, LoRARef] = {}
        self._minted: Set[str] = set()  # (never shrinks: an id is never given to a second load)
        for name, path in adapters:  # --lora-paths: loaded first, so each id is its name
            self.register(self.new_ref(name, path))

    def mint_lora_id(self, name: str) -> str:
        """A lora_id no load had before: `name`, else `name#k` for the first k >= 2 not minted yet
        (unique by construction: every id minted is kept, whatever the name that minted it)."""
        lora_id, k = name, 1
        while lora_id in self._minted:
            k += 1
            lora_id = f"{name}#{k}"
        self._minted.add(lora_id)
        return lora_id

    def new_ref(self, name: str, path: str, pinned: bool = False) -> LoRARef:
        """A ref with a fresh id for a load about to be sent; registered only once it succeeded."""
        return LoRARef(self.mint_lora_id(check_lora_name(name)), name, path, pinned)

    def check_new_name(self, name: str, max_loaded_loras: Optional[int]) -> None:
        """Whether adapter `name` may be loaded now: a free name, under --max-loaded-loras
        (SGLang's refusal, with the flag to raise). ValueError otherwise."""
        check_lora_name(name)
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

    def register(self, ref: LoRARef) -> None:
        if ref.lora_name in self._registry:  # (check_new_name ran first; this holds the invariant)
            raise ValueError(f"LoRA adapter {ref.lora_name!r} is already loaded")
        self._registry[ref.lora_name] = ref

    def unregister(self, name: str) -> LoRARef:
        """Forget `name` (requests naming it are refused from now on); returns its ref."""
        ref = self._registry.pop(name, None)
        if ref is None:
            raise ValueError(lora_not_loaded(name, self._registry))
        return ref

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


def lora_not_loaded(name: str, loaded: Iterable[str]) -> str:
    """The error of a request (or an unload) naming an adapter that is not loaded (the
    TokenizerManager's, the Engine's and the Scheduler's: one wording)."""
    names = sorted(loaded)
    listed = f"the loaded adapters are: {', '.join(names)}" if names else "no adapter is loaded"
    return f"LoRA adapter {name!r} is not loaded; {listed}"
