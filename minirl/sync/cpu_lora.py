"""LoRA on vLLM-CPU without a copy of the adapter per token.

vLLM 0.32's CPU LoRA ops (`vllm.lora.ops.torch_ops`, used by `PunicaWrapperCPU`) gather the LoRA weights per
token, `weights[token_indices]` (a [tokens, out, in] copy), then multiply with `einsum("bi,boi->bo")`. Every
token processed copies the whole adapter once, so a forward's cost grows with tokens x adapter bytes (what that
cost the demo's step and the sync check: BENCHMARKS.md, `minirl bench generation`).

`lora_matmul` does the same product as one matmul per adapter present in the batch (usually one), with no copy.
One departure from those ops, to follow vLLM's own definition: a token whose index is -1 ("no LoRA should be
applied", `punica_base`) gets no LoRA term, as the GPU kernels do; the torch ops index slot -1, the last slot.

`install()` swaps these in for vLLM's CPU ops in the process it runs in (through `minirl.sync.vllm_compat`); minirl runs it in vLLM's worker (on
import of its worker extension, `minirl.sync.receiver`), unless MINIRL_VLLM_CPU_LORA=0 is in the environment.
`minirl bench generation` (`cpu_lora`) compares the two on one engine."""
from __future__ import annotations

import os

import torch

from minirl.sync import vllm_compat


def lora_matmul(x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """rows[t] = weights[idx[t]] @ x[t] for every token t with idx[t] >= 0, as [tokens, out] in `dtype`; rows of
    tokens with idx -1 are not computed (zero). `weights`: [slots, out, in] or [slots, 1, out, in]. None when the
    shapes are not the ones this handles (the caller falls back to vLLM's op)."""
    w = weights.squeeze(1) if weights.dim() == 4 else weights
    if w.dim() != 3 or x.dim() != 2 or idx.dim() != 1 or idx.numel() != x.shape[0]:
        return None
    x = x.to(dtype)
    out = x.new_zeros(x.shape[0], w.shape[1])
    if x.shape[0] == 0:
        return out
    first = int(idx[0])
    if bool((idx == first).all()):  # one adapter for the whole batch: the usual case
        if first >= 0:
            torch.matmul(x, w[first].to(dtype).t(), out=out)
        return out
    for slot in torch.unique(idx).tolist():
        if slot >= 0:
            rows = (idx == slot).nonzero().squeeze(1)
            out[rows] = x[rows] @ w[slot].to(dtype).t()
    return out


def _ops(orig: dict):
    """Drop-in replacements for vLLM's bgmv_shrink / bgmv_expand / bgmv_expand_slice (same arguments and effect
    on the output tensor), falling back to `orig` on shapes `lora_matmul` does not handle."""

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        y = lora_matmul(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        if y is None:
            return orig["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        output_tensor[:, :y.shape[1]] = scaling * y

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        y = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if y is None:
            return orig["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        rows = 1 if y.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
        cols = min(y.shape[1], output_tensor.shape[1])  # adapter and model may pad differently (as vLLM's op)
        if add_inputs:
            output_tensor[:, :cols] += y[:rows, :cols]
        else:
            output_tensor[:, :cols] = y[:rows, :cols]

    def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size,
                          add_inputs=True):
        y = lora_matmul(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if y is None:
            return orig["bgmv_expand_slice"](inputs, lora_b_weights, output_tensor, lora_indices_tensor,
                                             slice_offset, slice_size, add_inputs)
        if add_inputs:
            output_tensor[:, slice_offset:slice_offset + slice_size] += y
        else:
            output_tensor[:, slice_offset:slice_offset + slice_size] = y
    return {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def install(on: bool = True) -> bool:
    """Put the ops above in place of vLLM's CPU LoRA ops in this process (the sgmv ops, for prefills, call the
    bgmv ones), or with `on=False` put vLLM's back (`minirl bench generation` swaps them on one engine);
    idempotent. Returns whether minirl's ops are in place (False also when vLLM's modules are not there, or the
    vLLM release is not one `minirl.sync.vllm_compat` was checked against)."""
    orig = vllm_compat.cpu_lora_ops(None)  # vLLM's own (put back for now)
    if orig is None:
        return False
    if on:
        vllm_compat.cpu_lora_ops(_ops(orig))
    return on


def installed() -> bool:
    """Whether minirl's ops are in place in this process."""
    return vllm_compat.cpu_lora_ops_replaced()


def install_default() -> bool:
    """`install()` unless MINIRL_VLLM_CPU_LORA=0 in the environment (then vLLM's own ops are in place)."""
    return install(os.environ.get("MINIRL_VLLM_CPU_LORA", "1") != "0")
