"""The engine's side of an adapter served from memory, in vLLM's LoRA terms (runs in the engine worker; imports vLLM
lazily). Used by `minirl.sync.receiver`.

- `StoredAdapter`: what vLLM's loader builds a LoRA id's `LoRAModel` from (the receiver's in-memory store).
- `build_lora`: that `LoRAModel` (what vLLM's `_load_adapter` does for a folder), as a `Built`: the model, the
  flat buffer its tensors are views of, and the scaling vLLM folds into each lora_B.
- `plan_slot`: a `SlotPlan`, where each of a built adapter's tensors sits in its slot of vLLM's stacked LoRA
  tensors, so that an in-place swap is plain copies into the slot (`SlotPlan.copy_in`), no LoRAModel rebuilt.
  The LoRAModel's own tensors are then older than the slot until `SlotPlan.flush` copies the slot back.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from minirl.core.adapter import unpack
from minirl.sync import vllm_compat as compat


def same_layout(a: dict, b: dict) -> bool:
    """Same tensors at the same offsets under the same LoRA config (the dtype may differ)."""
    return all(a[k] == b[k] for k in ("names", "shapes", "offsets", "peft_config"))


@dataclass(frozen=True)
class Built:
    """The `LoRAModel` vLLM registered for a LoRA id, and what the fast in-place path needs of it."""
    lora: Any                  # vllm.lora.lora_model.LoRAModel
    own: torch.Tensor          # the flat buffer (vLLM's LoRA dtype) its tensors are views of; lora_B scaled by vLLM
    scales: tuple[tuple[torch.Tensor, float], ...]  # (lora_B view of `own`, the scaling vLLM folds into it)
    layout: dict               # the layout the adapter came in

    def unscaled(self) -> torch.Tensor:
        """A copy of `own` with vLLM's scaling undone: the adapter as it was pushed (in the LoRA dtype)."""
        flat = self.own.clone()
        for b, sc in self.scales:
            off = (b.data_ptr() - self.own.data_ptr()) // self.own.element_size()
            flat[off:off + b.numel()].div_(sc)
        return flat


@dataclass(frozen=True)
class StoredAdapter:
    """An adapter the receiver serves under one LoRA id: `flat` (a CPU copy, in the layout's order and dtype), or
    None after a fast in-place install, when the adapter lives only in the slot and the `Built` model's tensors
    (`Built.unscaled` recovers it)."""
    layout: dict
    flat: torch.Tensor | None


@dataclass(frozen=True)
class SlotCopy:
    """One channel buffer's tensors matched with their slot views, in buffer order, with where each one ends."""
    flat_ptr: int
    dst: list[torch.Tensor]
    src: list[torch.Tensor]
    ends: list[int]


@dataclass(eq=False)
class SlotPlan:
    """Where a built adapter's tensors sit in slot `slot` of vLLM's stacked LoRA tensors. Valid while the
    registered `LoRAModel` (`lora`) and its slot stay the same. Its fields never change; `last` caches the
    copies from the last channel buffer (a channel maps one buffer)."""
    lora: Any
    slot: int
    layout: dict
    dst: list[torch.Tensor]     # slot views, one per LoRA tensor
    own: list[torch.Tensor]     # the LoRAModel's tensors (views of `Built.own`), in the same order
    offsets: list[int]          # element offset of each in any flat buffer of `layout`
    scaled: tuple[tuple[float, list[torch.Tensor]], ...]  # slot views of the lora_B vLLM scales, by factor
    last: SlotCopy | None = field(default=None, repr=False)

    def fits(self, layout: dict, flat: torch.Tensor) -> bool:
        return same_layout(self.layout, layout) and int(layout["numel"]) == flat.numel()

    def copies(self, flat: torch.Tensor) -> SlotCopy:
        """The copies from `flat`, slot views and buffer views in buffer order."""
        if self.last is not None and self.last.flat_ptr == flat.data_ptr():
            return self.last
        order = sorted(range(len(self.own)), key=self.offsets.__getitem__)
        got = SlotCopy(flat.data_ptr(), [self.dst[i] for i in order],
                       [flat[self.offsets[i]:self.offsets[i] + self.own[i].numel()].view(self.own[i].shape)
                        for i in order],
                       [self.offsets[i] + self.own[i].numel() for i in order])
        self.last = got
        return got

    def copy_in(self, flat: torch.Tensor, ready: Callable[[int], int]) -> float:
        """Copy `flat`'s tensors into the slot (converted to the slot's dtype), each as soon as `ready(upto)` says
        the first `upto` elements are there (it returns how many are), then scale lora_B there as vLLM would fold
        it (nothing to scale when it arrived pre-scaled: vLLM's scaling is then 1). Returns the copy's end
        (perf_counter), before the scaling."""
        c = self.copies(flat)
        i = 0
        while i < len(c.ends):
            done, j = ready(c.ends[i]), i
            while j < len(c.ends) and c.ends[j] <= done:
                j += 1
            compat.foreach_copy(c.dst[i:j], c.src[i:j])
            i = j
        t_copy = time.perf_counter()
        for sc, ds in self.scaled:
            compat.foreach_mul(ds, sc)
        if flat.is_cuda:  # done reading the sender's buffer before it may be packed again
            torch.cuda.current_stream(flat.device).synchronize()
        return t_copy

    def flush(self) -> None:
        """Bring the LoRAModel's own tensors up to the slot (before anything reads them or reuses the slot)."""
        compat.foreach_copy(self.own, self.dst)


def build_lora(wm, lora_id: int, flat: torch.Tensor, layout: dict) -> Built:
    """A vLLM `LoRAModel` for `lora_id` from `flat` (the adapter as pushed, laid out by `layout`), for the worker
    LoRA manager `wm`; raises when the engine's LoRA config refuses it or no tensor is a known LoRA weight."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    helper = PEFTHelper.from_dict({**layout["peft_config"], "vllm_max_position_embeddings": wm.max_position_embeddings})
    helper.validate_legal(wm.lora_config)
    model = compat.adapter_manager(wm).model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    # vLLM folds the scaling into lora_b in place: give it its own copy (in its LoRA dtype, so that the
    # LoRAModel's tensors are views of it), keep the store pristine
    dtype = wm.lora_config.lora_dtype if isinstance(wm.lora_config.lora_dtype, torch.dtype) else flat.dtype
    own = flat.to(dtype=dtype, copy=True)
    lora = LoRAModel.from_lora_tensors(
        lora_model_id=lora_id, tensors=unpack(own, layout), peft_helper=helper, device="cpu",
        dtype=wm.lora_config.lora_dtype, model_vocab_size=wm.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    if not lora.loras:
        raise RuntimeError("minirl adapter receiver: none of the pushed tensors is a LoRA weight vLLM knows")
    scales = tuple((lw.lora_b, float(lw.scaling)) for lw in lora.loras.values()
                   if isinstance(lw.lora_b, torch.Tensor) and isinstance(lw.scaling, (int, float)))
    return Built(lora, own, scales, layout)


def plan_slot(mgr, built: Built, slot: int) -> SlotPlan | None:
    """The `SlotPlan` of `built` in slot `slot` of vLLM's LoRA model manager `mgr`, or None when some layer is not
    a plain (tp=1, one LoRA per slice) linear LoRA layer, or vLLM copied the tensors (dtype conversion) instead of
    viewing `built.own`: then vLLM's own full reload path is used."""
    own = built.own
    lo, hi = own.data_ptr(), own.data_ptr() + own.numel() * own.element_size()

    def aliased(t) -> bool:
        return lo <= t.data_ptr() < hi
    if not all(aliased(b) for b, _ in built.scales):
        return None
    pairs = compat.slot_pairs(mgr, built.lora, slot)
    if pairs is None:
        return None
    dst, src = [d for d, _ in pairs], [t for _, t in pairs]
    if not src or not all(aliased(t) for t in src):
        return None
    scale_of = {id(b): sc for b, sc in built.scales if sc != 1.0}
    by_scale: dict[float, list] = {}
    for d, t in zip(dst, src):
        if id(t) in scale_of:
            by_scale.setdefault(scale_of[id(t)], []).append(d)
    offsets = [(t.data_ptr() - lo) // own.element_size() for t in src]  # the same tensors in any flat of this layout
    return SlotPlan(built.lora, slot, built.layout, dst, src, offsets, tuple(by_scale.items()))
