"""The LoRA trainer: base model + peft adapter, token-level GRPO-family loss, token-budget micro-batches.

Logprobs are computed per micro-batch from the final hidden states of the completion tokens only, in chunks,
so float32 logits never exist for the whole batch (nor for prompt or padding positions).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from .config import Config
from .loss import policy_loss, token_weights
from .models import load_tokenizer, resolve_model
from .types import ScoredGroup

LOGIT_CHUNK = 1024  # completion tokens per lm_head chunk


@dataclass(frozen=True)
class Sample:
    """One completion ready for the loss."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    behav_logp: tuple[float, ...]
    versions: tuple[int, ...]
    advantage: float


@dataclass
class Batch:
    """Right-padded prompt+completion rows. `tgt_mask_B_L[b, t]` marks completion tokens (the loss targets);
    per-token tensors are aligned to the token they score."""
    input_ids_B_L: torch.Tensor
    attn_B_L: torch.Tensor
    tgt_mask_B_L: torch.Tensor
    behav_logp_B_L: torch.Tensor
    version_B_L: torch.Tensor
    adv_B: torch.Tensor
    weight_B_L: torch.Tensor  # aggregation weights over the whole batch

    @property
    def n_tokens(self) -> int:
        return int(self.tgt_mask_B_L.sum())

    def to(self, device) -> "Batch":
        return Batch(*(t.to(device) for t in (self.input_ids_B_L, self.attn_B_L, self.tgt_mask_B_L,
                                             self.behav_logp_B_L, self.version_B_L, self.adv_B, self.weight_B_L)))

    def rows(self, idx: list[int]) -> "Batch":
        width = int(self.attn_B_L[idx].sum(1).max())
        return Batch(*(t[idx][:, :width] if t.dim() == 2 else t[idx] for t in (
            self.input_ids_B_L, self.attn_B_L, self.tgt_mask_B_L, self.behav_logp_B_L, self.version_B_L,
            self.adv_B, self.weight_B_L)))

    def micro_batches(self, token_budget: int) -> Iterator["Batch"]:
        """Rows sorted by length, packed greedily so that rows * longest row <= token_budget."""
        lens = self.attn_B_L.sum(1).tolist()
        order = sorted(range(len(lens)), key=lambda i: -lens[i])
        cur: list[int] = []
        for i in order:
            if cur and (len(cur) + 1) * lens[cur[0]] > token_budget:
                yield self.rows(cur)
                cur = []
            cur.append(i)
        if cur:
            yield self.rows(cur)


def samples_from_groups(groups: Sequence[ScoredGroup], keep_zero_adv: bool = False) -> list[Sample]:
    """Included samples with their advantages. Zero-advantage samples carry no policy gradient and are
    dropped unless a KL term needs them (`keep_zero_adv`)."""
    out = []
    for g in groups:
        for c, r, a in zip(g.group.completions, g.rewards, g.advantages):
            if r is None or not c.token_ids or (a == 0.0 and not keep_zero_adv):
                continue
            out.append(Sample(g.group.prompt.token_ids, c.token_ids, c.logprobs, c.versions, a))
    return out


def make_batch(samples: Sequence[Sample], pad_id: int, agg: str, max_tokens: int) -> Batch:
    L = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    B = len(samples)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    tgt = torch.zeros((B, L), dtype=torch.bool)
    behav = torch.zeros((B, L))
    ver = torch.zeros((B, L), dtype=torch.long)
    for b, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[b, : p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        attn[b, : p + c] = 1
        tgt[b, p: p + c] = True
        behav[b, p: p + c] = torch.tensor(s.behav_logp)
        ver[b, p: p + c] = torch.tensor(s.versions)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return Batch(ids, attn, tgt, behav, ver, adv, token_weights(tgt, agg, max_tokens))


def completion_logprobs(model, batch: Batch, temperature: float, with_entropy: bool = False):
    """Per-token logprobs (B, L) of the completion tokens under `model` (a peft or plain causal LM), with
    temperature applied, plus the summed entropy of those positions when asked (no grad)."""
    inner, head = _decoder_and_head(model)
    hidden = inner(input_ids=batch.input_ids_B_L, attention_mask=batch.attn_B_L).last_hidden_state
    pick = batch.tgt_mask_B_L[:, 1:]
    h_N_H = hidden[:, :-1][pick]
    targets_N = batch.input_ids_B_L[:, 1:][pick]
    logps, ent = [], 0.0
    for s in range(0, h_N_H.shape[0], LOGIT_CHUNK):
        logits = head(h_N_H[s: s + LOGIT_CHUNK]).float() / temperature
        lse = torch.logsumexp(logits, -1)
        logps.append(logits.gather(-1, targets_N[s: s + LOGIT_CHUNK, None]).squeeze(-1) - lse)
        if with_entropy:
            with torch.no_grad():
                ent += float((lse - (torch.softmax(logits, -1) * logits).sum(-1)).sum())
    logp_N = torch.cat(logps) if logps else h_N_H.new_zeros(0)
    out = torch.zeros(batch.tgt_mask_B_L.shape, dtype=logp_N.dtype, device=logp_N.device)
    out = out.masked_scatter(batch.tgt_mask_B_L.to(out.device), logp_N)
    return out, ent


def _decoder_and_head(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def sequence_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> list[float]:
    """Logprobs of one completion: the trainer-side reference for sync verification and tests."""
    s = Sample(tuple(prompt_ids), tuple(completion_ids), (0.0,) * len(completion_ids), (0,) * len(completion_ids), 0.0)
    b = make_batch([s], pad_id=0, agg="token-mean", max_tokens=len(completion_ids))
    b = b.to(next(model.parameters()).device)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, b, temperature)
    return lp[b.tgt_mask_B_L].tolist()


def _dtype(cfg: Config) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return getattr(torch, cfg.dtype)


def build_model(cfg: Config, device: str):
    """The base model with a fresh LoRA adapter (peft), as the trainer and a generator process build it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from .transports import make_contiguous
    kw = {}
    if cfg.load_in_4bit:
        from transformers import BitsAndBytesConfig
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=_dtype(cfg))
    base = AutoModelForCausalLM.from_pretrained(resolve_model(cfg.model), dtype=_dtype(cfg), **kw)
    if not cfg.load_in_4bit:
        base = base.to(device)
    base.config.use_cache = False
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.target_modules, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    make_contiguous(model)  # one buffer for the whole adapter: a sync packs it with one copy
    return model


class Trainer:
    """Owns the peft model and the optimizer. `step(groups)` runs one update and bumps `version`."""

    def __init__(self, cfg: Config, device: str | None = None):
        self.cfg = cfg
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model_path = resolve_model(cfg.model)
        self.tokenizer = load_tokenizer(cfg.model)
        torch.manual_seed(cfg.seed)
        self.model = build_model(cfg, self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.version = 0

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.lr_schedule == "cosine":
            t = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    def set_lr(self, lr: float) -> None:
        self.cfg.lr = lr
        for g in self.opt.param_groups:
            g["initial_lr"] = lr
        self.sched.base_lrs = [lr for _ in self.sched.base_lrs]

    def step(self, groups: Sequence[ScoredGroup]) -> dict[str, float]:
        """One rollout batch → `ppo_epochs` optimizer steps. Returns the step's trainer metrics."""
        c = self.cfg
        t0 = time.perf_counter()
        samples = samples_from_groups(groups, keep_zero_adv=c.kl_coef > 0)
        m: dict[str, float] = {"train/samples": len(samples)}
        if not samples:  # nothing to learn from (all groups zero-advantage or failed): still a version
            self.version += 1
            m.update({"train/tokens": 0, "time/train_s": time.perf_counter() - t0, "version": self.version})
            return m
        batch = make_batch(samples, self.tokenizer.pad_token_id, c.loss_agg, c.max_tokens)
        micro = [mb.to(self.device) for mb in batch.micro_batches(c.token_budget)]
        olds: list[torch.Tensor] = []
        self.model.train()
        tot = dict(loss=0.0, clipped=0.0, behav_clipped=0.0, is_trunc=0.0, is_w=0.0, kl_b=0.0, kl_r=0.0, mism=0.0,
                   ent=0.0, n=0)
        for epoch in range(c.ppo_epochs):
            self.opt.zero_grad(set_to_none=True)
            for i, mb in enumerate(micro):
                logp, ent = completion_logprobs(self.model, mb, c.temperature, with_entropy=epoch == 0)
                if epoch == 0:
                    olds.append(logp.detach())
                ref = None
                if c.kl_coef > 0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref, _ = completion_logprobs(self.model, mb, c.temperature)
                out = policy_loss(logp, olds[i], mb.behav_logp_B_L, mb.adv_B, mb.weight_B_L, mb.tgt_mask_B_L,
                                  c.clip_low, c.clip_high, c.tis_cap, ref, c.kl_coef, c.opsm_delta,
                                  c.behav_clip)
                out.loss.backward()
                if epoch == 0:
                    for k, v in (("clipped", out.clipped), ("behav_clipped", out.behav_clipped),
                                 ("is_trunc", out.is_truncated), ("is_w", out.is_weight_sum),
                                 ("kl_b", out.kl_behav_sum), ("kl_r", out.kl_ref_sum), ("mism", out.mismatch_sum),
                                 ("ent", ent), ("n", out.n_tokens)):
                        tot[k] += v
                    tot["loss"] += out.loss.item()
                elif epoch == c.ppo_epochs - 1:
                    tot["clipped"] += out.clipped
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], c.max_grad_norm)
            self.opt.step()
            self.sched.step()
            self.version += 1
        n = max(1, tot["n"])
        m.update({
            "loss": tot["loss"], "clip_frac": tot["clipped"] / n, "clip_frac/behav": tot["behav_clipped"] / n,
            "kl_behav": tot["kl_b"] / n,
            "kl_ref": tot["kl_r"] / n, "entropy": tot["ent"] / n, "is_weight/mean": tot["is_w"] / n,
            "is_weight/truncated_frac": tot["is_trunc"] / n, "logprob_mismatch": tot["mism"] / n,
            "grad_norm": float(grad_norm), "lr": self.sched.get_last_lr()[0],
            "train/tokens": batch.n_tokens, "train/micro_batches": len(micro),
            "time/train_s": time.perf_counter() - t0, "version": self.version,
        })
        return m

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float) -> list[float]:
        self.model.eval()
        return sequence_logprobs(self.model, list(prompt_ids), list(completion_ids), temperature)

    def save_adapter(self, path: str | Path) -> Path:
        """The adapter in standard peft format (adapter_config.json + adapter_model.safetensors)."""
        path = Path(path)
        self.model.save_pretrained(path, safe_serialization=True)
        return path

    def state_dict(self) -> dict:
        return {"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "version": self.version,
                "rng": torch.get_rng_state()}

    def load_state(self, adapter_dir: str | Path, state: dict) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file
        set_peft_model_state_dict(self.model, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.version = state["version"]
        torch.set_rng_state(state["rng"])
