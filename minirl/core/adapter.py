"""The adapter as one flat buffer: what the trainer and every adapter receiver share.

The LoRA parameters of a peft model, in a fixed order (all lora_A, then all lora_B), are the adapter. The trainer
keeps them as consecutive views of one buffer (`make_contiguous`), so a sync packs the whole adapter with one
copy (`Packer`), optionally converted to the receiver's dtype and with lora_B pre-scaled; the receiver sees the
same tensors through `unpack(flat, layout)`. A `layout` is plain values (names, shapes, offsets, dtype, the peft
config), so it travels through vLLM's engine calls as it is.
"""
from __future__ import annotations

import enum
import json

import torch
from peft import get_peft_model_state_dict


def _jsonable(x):
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, enum.Enum):
        return x.value
    return str(x)


def adapter_params(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """peft-format name (as in adapter_model.safetensors) -> the live LoRA parameter of a peft model; all lora_A
    first, then all lora_B (so the B scaling is one range of a packed buffer)."""
    want = set(get_peft_model_state_dict(model, adapter_name=adapter))
    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            key = n.replace(f".{adapter}.", ".")
            if key in want:
                out[key] = p
    missing = want - set(out)
    if missing:
        raise ValueError(f"adapter tensors without a parameter: {sorted(missing)[:3]} …")
    return dict(sorted(out.items(), key=lambda kv: ".lora_B." in kv[0]))  # stable: model order within A, B


def make_contiguous(model, adapter: str = "default") -> torch.Tensor | None:
    """Rebind the adapter's LoRA parameters to consecutive views of one buffer, in `adapter_params` order, so that
    a sync packs the whole adapter with one flat copy instead of hundreds of small ones. Call it before the
    optimizer is built. Returns the buffer (None, changing nothing, when the parameters differ in dtype/device)."""
    params = list(adapter_params(model, adapter).values())
    if not uniform(params):
        return None
    return move_into(params, torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                                         device=params[0].device))


def uniform(params: list[torch.Tensor]) -> bool:
    """One dtype and one device for all (what one flat buffer needs)."""
    return bool(params) and len({(p.dtype, p.device) for p in params}) == 1


def move_into(params: list[torch.Tensor], flat: torch.Tensor) -> torch.Tensor:
    """Copy `params` into consecutive views of `flat` (same dtype and device) and rebind them there. A parameter
    keeps its identity (the optimizer and its state are untouched); only its storage moves."""
    off = 0
    with torch.no_grad():
        for p in params:
            view = flat[off:off + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            off += p.numel()
    return flat


def _span(ts: list[torch.Tensor]) -> torch.Tensor | None:
    """One 1-D tensor over `ts` when they are consecutive contiguous views of one storage, in order; else None."""
    t0 = ts[0]
    ptr, es, base = t0.data_ptr(), t0.element_size(), t0.untyped_storage().data_ptr()
    for t in ts:
        if (t.data_ptr() != ptr or not t.is_contiguous() or t.dtype != t0.dtype
                or t.untyped_storage().data_ptr() != base):
            return None
        ptr += t.numel() * es
    return t0.detach().as_strided(((ptr - t0.data_ptr()) // es,), (1,))


def peft_config_dict(model, adapter: str = "default") -> dict:
    return json.loads(json.dumps(model.peft_config[adapter].to_dict(), default=_jsonable))


def b_scalings(model, adapter: str = "default") -> dict[str, float]:
    """peft-format name of each lora_B weight -> the scaling peft applies to that module's LoRA output (alpha / r,
    or alpha / sqrt(r) with rsLoRA; per-module rank/alpha patterns included)."""
    out = {}
    for name, module in model.named_modules():
        sc = getattr(module, "scaling", None)
        if isinstance(sc, dict) and adapter in sc and hasattr(module, "lora_B"):
            out[f"{name}.lora_B.weight"] = float(sc[adapter])
    return out


def prescaled_config(peft_config: dict) -> dict:
    """The peft config to send with pre-scaled lora_B tensors: vLLM then computes scaling 1 and folds nothing."""
    return {**peft_config, "lora_alpha": peft_config["r"], "use_rslora": False, "alpha_pattern": {}}


def make_layout(tensors: dict[str, torch.Tensor], peft_config: dict, dtype: torch.dtype | None = None) -> dict:
    """Names, shapes and element offsets of the tensors in one flat buffer (plain values, msgpack-able)."""
    dtype = dtype or next(iter(tensors.values())).dtype
    names, shapes, offsets, off = [], [], [], 0
    for n, t in tensors.items():
        names.append(n)
        shapes.append(list(t.shape))
        offsets.append(off)
        off += t.numel()
    return {"names": names, "shapes": shapes, "offsets": offsets, "numel": off, "dtype": str(dtype),
            "nbytes": off * torch.empty((), dtype=dtype).element_size(), "peft_config": peft_config}


class Packer:
    """Copies the live tensors into a flat buffer laid out by `layout`: one flat copy when they are consecutive views
    of one buffer in layout order (`make_contiguous`), else one fused `_foreach_copy_`. With `scales` (name ->
    factor, e.g. `b_scalings`) those tensors are multiplied in the buffer (one `mul_` per run of equal factors):
    the LoRA scaling travels folded into lora_B, so the engine has nothing left to scale."""

    def __init__(self, tensors: dict[str, torch.Tensor], flat: torch.Tensor, layout: dict,
                 scales: dict[str, float] | None = None):
        self.src = list(tensors.values())
        self.flat = flat
        views = unpack(flat, layout)
        self.dst = [views[n] for n in tensors]
        self.runs: list[list] = []  # [start, end, factor]: ranges of `flat` to scale
        order = sorted(zip(layout["offsets"], layout["names"]))
        for off, n in order:
            sc = (scales or {}).get(n, 1.0)
            end = off + views[n].numel()
            if sc == 1.0:
                continue
            if self.runs and self.runs[-1][1] == off and self.runs[-1][2] == sc:
                self.runs[-1][1] = end
            else:
                self.runs.append([off, end, sc])
        in_order = [n for _, n in order] == list(tensors)
        self._span = _span(self.src) if in_order and views and flat.numel() == layout["numel"] else None
        self._ptrs = [t.data_ptr() for t in self.src]

    @torch.no_grad()
    def pack(self) -> None:
        for _ in self.pack_chunks(self.flat.numel()):
            pass

    @torch.no_grad()
    def pack_chunks(self, chunk: int):
        """Pack in ranges of about `chunk` elements, yielding after each the number of leading elements of the
        buffer that are final (copied and scaled), so that a reader can start on them; cache-hot per range."""
        n = self.flat.numel()
        if self._span is None or [t.data_ptr() for t in self.src] != self._ptrs:
            torch._foreach_copy_(self.dst, [t.detach() for t in self.src])
            self._scale(0, n)
            yield n
            return
        for lo in range(0, n, max(1, chunk)):
            hi = min(n, lo + chunk)
            self.flat[lo:hi].copy_(self._span[lo:hi])
            self._scale(lo, hi)
            yield hi

    def _scale(self, lo: int, hi: int) -> None:
        for a, b, sc in self.runs:  # in the buffer's dtype, as vLLM folds it (a fused out= mul measured slower)
            if a < hi and b > lo:
                self.flat[max(a, lo):min(b, hi)].mul_(sc)


def torch_dtype(name: str):
    return getattr(torch, name.removeprefix("torch."))


def unpack(flat, layout: dict) -> dict:
    """name -> view of `flat` (1-D, layout dtype), in the layout's shapes."""
    return {n: flat[o:o + _numel(s)].view(s) for n, s, o in zip(layout["names"], layout["shapes"], layout["offsets"])}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
