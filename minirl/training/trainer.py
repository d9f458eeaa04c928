"""The LoRA trainer: base model + peft adapter, token-level GRPO-family loss, token-budget micro-batches."""
from __future__ import annotations

import ctypes
import math
import platform
import time
import warnings
from pathlib import Path
from typing import Sequence

import torch
from peft import set_peft_model_state_dict
from safetensors.torch import load_file

from minirl.config import Config
from minirl.core.logits import Processing
from minirl.core.metrics import memory_metrics
from minirl.core.xray import TokenXray
from minirl.training.batch import (
    Batch,
    Sample,
    SampleFilter,
    completion_logprobs,
    make_batch,
    samples_from_groups,
    sequence_logprobs,
)
from minirl.training.loss import LossInputs, LossSettings
from minirl.training.loss_fn import resolve_loss_fn, run_loss, top_entropy_masks
from minirl.training.models import build_model, checkpointing_on, load_tokenizer, resolve_model
from minirl.training.packing import MASKABLE_ATTENTION, PackedMicroBatch, pack, packed_completion_logprobs
from minirl.training.plan import resolve_token_budget
from minirl.training.xray import XrayProbe
from minirl.types import ScoredGroup

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def fix_malloc_threshold(nbytes: int = 128 * 1024) -> bool:
    """Fix glibc's mmap threshold at `nbytes` (its initial value), so that every tensor above it is mapped on its
    own and given back to the system when freed. Left dynamic, glibc raises the threshold to the largest block
    freed so far (up to 32 MiB): activation tensors then come from the heap, which keeps what they freed, and a
    CPU training step's resident peak was ~2.5x its live bytes (BENCHMARKS.md, "Memory and the memory plan").
    Process-wide and idempotent; False where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, nbytes))


class Trainer:
    """Owns the peft model and the optimizer. `step(groups)` runs one update (`ppo_epochs` optimizer steps) and
    bumps `version` by one.

    `packing` is the layout the trainer uses: `cfg.packing`, except that 'shared-prefix' falls back to 'padded'
    (with one printed line) where the model's attention implementation cannot take a custom mask."""

    def __init__(self, cfg: Config, device: str | None = None, token_budget: int | None = None):
        self.cfg = cfg
        self.loss_fn = resolve_loss_fn(cfg.loss_fn)  # a bad 'module:function': one line, before the model loads
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cpu" and cfg.cpu_compact_memory:
            fix_malloc_threshold()  # resident memory then follows the live tensors (the memory plan counts those)
        self.model_path = resolve_model(cfg.model)
        # 'auto': the run's memory plan's choice (`token_budget`), or the trainer's alone (`resolve_token_budget`)
        self.planned_budget = token_budget or resolve_token_budget(cfg, self.device)
        self.token_budget = self.planned_budget
        self.tokenizer = load_tokenizer(cfg.model, cfg.model_kwargs, cfg.chat_template)
        torch.manual_seed(cfg.seed)
        self.checkpointing = checkpointing_on(cfg, self.device)
        self.model = build_model(cfg, self.device, checkpointing=self.checkpointing)
        self.packing = cfg.packing
        attn = self.model.get_base_model().config._attn_implementation
        if self.packing == "shared-prefix" and attn not in MASKABLE_ATTENTION:
            print(f"minirl: packing 'shared-prefix' needs an attention implementation that takes a custom mask "
                  f"({', '.join(MASKABLE_ATTENTION)}); this model uses {attn!r}: training uses packing 'padded'")
            self.packing = "padded"
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, self._lr_factor)
        self.version = 0
        self.xrays: list[TokenXray] = []  # the last step's (`step`)
        memory_metrics()  # the first step's memory window starts here, after the model loaded

    def _lr_factor(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup_steps:
            return (step + 1) / c.warmup_steps
        if c.lr_schedule == "cosine":
            t = (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))
        return 1.0

    def reconfigure(self, cfg: Config) -> None:
        """Take a new config mid-run (`Run.set`): the loss settings from the next step, and its learning rate."""
        self.loss_fn = resolve_loss_fn(cfg.loss_fn)
        self.cfg = cfg
        self.token_budget = self.planned_budget if cfg.token_budget == "auto" else int(cfg.token_budget)
        for g in self.opt.param_groups:
            g["initial_lr"] = cfg.lr
        self.sched.base_lrs = [cfg.lr for _ in self.sched.base_lrs]

    def samples(self, groups: Sequence[ScoredGroup]) -> list[Sample]:
        """The step's trained samples: zero-advantage ones only when the KL term or `train_zero_adv` wants them,
        truncated ones not with `mask_truncated`."""
        return samples_from_groups(groups, SampleFilter.from_config(self.cfg))

    def step(self, groups: Sequence[ScoredGroup]) -> dict[str, float]:
        """One rollout batch → `ppo_epochs` optimizer steps. Returns the step's trainer metrics. Logprobs are
        computed at the temperature each group was sampled with (it travels with the group). Sets `xrays`: the
        token X-rays of the completions `metrics.sample_rows` logs (cfg.log_samples; `step_xray`)."""
        m, self.xrays = self.step_xray(groups, self.cfg.log_samples)
        return m

    def step_xray(self, groups: Sequence[ScoredGroup], n: int) -> tuple[dict[str, float], list[TokenXray]]:
        """`step`, plus the token X-ray of the first completion of each of the first `n` groups (those
        `metrics.sample_rows` logs), copied off the step's own tensors (`training/xray.py`)."""
        c = self.cfg
        loss_settings = LossSettings.from_config(c)
        t0 = time.perf_counter()
        if any(len(g.advantages) != len(g.rewards) for g in groups):
            raise ValueError("Trainer.step needs the step's advantages: pass the groups through "
                             "minirl.rewards.advantages.step_advantages(groups, AdvantageSettings.from_config(cfg))")
        keep = SampleFilter.from_config(c)  # one filter: the batch's and the X-rays' notes of why a sample is not in it
        samples = samples_from_groups(groups, keep)
        probe = XrayProbe(groups, samples, n, self.tokenizer, self.version, keep)
        m: dict[str, float] = {"train/samples": len(samples)}
        if not samples:  # nothing to learn from (all groups zero-advantage or failed): still a version
            self.version += 1
            m.update({"train/tokens": 0, "time/train_s": time.perf_counter() - t0, "version": self.version,
                      "train/skipped_nonfinite": 0, **memory_metrics()})
            return m, probe.records
        batch = make_batch(samples, self.tokenizer.pad_token_id, c.recipe.loss_agg, c.max_tokens)
        if self.packing == "shared-prefix":
            micro = [mb.to(self.device) for mb in pack(samples, batch, self.token_budget)]
        else:
            micro = [mb.to(self.device) for mb in batch.micro_batches(self.token_budget)]
        olds: list[torch.Tensor] = []
        self.model.train()
        ents0, tops = self._top_entropy(micro) if c.top_entropy_quantile < 1 else ([None] * len(micro),) * 2
        tot = dict(loss=0.0, clipped=0.0, behav_clipped=0.0, is_trunc=0.0, is_mask=0.0, is_w=0.0, kl_b=0.0, kl_r=0.0,
                   mism=0.0, ent=0.0, n=0)
        skipped = 0
        for epoch in range(c.ppo_epochs):
            self.opt.zero_grad(set_to_none=True)
            epoch_loss = 0.0
            for i, mb in enumerate(micro):
                rows = mb if isinstance(mb, Batch) else mb.rows
                ent_B_L = ents0[i]  # top_entropy_quantile's (no grad), or None
                if c.entropy_coef > 0:  # the bonus needs each token's entropy with its gradient
                    logp, ent_B_L = self._logprobs(mb, with_entropy="grad")
                    ent = float((ent_B_L.detach() * rows.tgt_mask_B_L).sum())
                else:
                    logp, ent = self._logprobs(mb, with_entropy=epoch == 0)
                if epoch == 0:
                    olds.append(logp.detach())
                ref = None
                if c.kl_coef > 0:
                    with torch.no_grad(), self.model.disable_adapter():
                        ref, _ = self._logprobs(mb)
                inputs = LossInputs(logp, olds[i], rows.behav_logp_B_L, rows.adv_B, rows.weight_B_L,
                                    rows.tgt_mask_B_L, loss_settings, ref, ent_B_L, tops[i])
                out = run_loss(self.loss_fn, inputs)
                if epoch == c.ppo_epochs - 1:
                    probe.see(inputs, rows.index_B)
                out.loss.backward()
                epoch_loss += out.loss.item()
                if epoch == 0:
                    for k, v in (("clipped", out.clipped), ("behav_clipped", out.behav_clipped),
                                 ("is_trunc", out.is_truncated), ("is_mask", out.is_masked),
                                 ("is_w", out.is_weight_sum), ("kl_b", out.kl_behav_sum), ("kl_r", out.kl_ref_sum),
                                 ("mism", out.mismatch_sum), ("ent", ent), ("n", out.n_tokens)):
                        tot[k] += v
                    tot["loss"] += out.loss.item()
                elif epoch == c.ppo_epochs - 1:
                    tot["clipped"] += out.clipped
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in self.model.parameters() if p.requires_grad], c.max_grad_norm)
            if math.isfinite(float(grad_norm)) and math.isfinite(epoch_loss):
                self.opt.step()
            else:  # a NaN/inf loss or gradient: no update (the adapter and AdamW's moments stay as they were)
                self.opt.zero_grad(set_to_none=True)
                skipped += 1
        # One version and one schedule step per trainer step, whatever ppo_epochs is: a version is an adapter the
        # generator can be given (the pipeline's depth bound and staleness count them), and `steps`, `warmup_steps`
        # and the cosine are in run steps. Skipped updates count.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step()`")
            self.sched.step()
        self.version += 1
        n = max(1, tot["n"])
        m.update({
            "loss": tot["loss"], "clip_frac": tot["clipped"] / n, "clip_frac/behav": tot["behav_clipped"] / n,
            "kl_behav": tot["kl_b"] / n,
            "kl_ref": tot["kl_r"] / n, "entropy": tot["ent"] / n, "is_weight/mean": tot["is_w"] / n,
            "is_weight/truncated_frac": tot["is_trunc"] / n, "is_weight/masked_frac": tot["is_mask"] / n,
            "logprob_mismatch": tot["mism"] / n,
            "grad_norm": float(grad_norm), "lr": self.sched.get_last_lr()[0],
            "train/tokens": batch.n_tokens, "train/micro_batches": len(micro),
            "train/forward_tokens": sum(mb.n_real_tokens if isinstance(mb, PackedMicroBatch) else
                                        mb.input_ids_B_L.numel() for mb in micro),
            "time/train_s": time.perf_counter() - t0, "version": self.version, "train/skipped_nonfinite": skipped,
            **memory_metrics(),
        })
        return m, probe.records

    def _top_entropy(self, micro: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each micro-batch's token entropies at the start of the step and top_entropy_quantile's mask from them,
        over all of the step's tokens: one forward without gradient before the update (only when it is < 1)."""
        ents, masks = [], []
        with torch.no_grad():
            for mb in micro:
                ents.append(self._logprobs(mb, with_entropy="tokens")[1])
                masks.append((mb if isinstance(mb, Batch) else mb.rows).tgt_mask_B_L)
        return ents, top_entropy_masks(ents, masks, self.cfg.top_entropy_quantile)

    def _logprobs(self, mb: "Batch | PackedMicroBatch", with_entropy: bool | str = False):
        """The completion tokens' logprobs under the distribution they were sampled from: temperature (each
        group's own), min_p and repetition_penalty re-applied as the generator applied them (`sampling.py`)."""
        proc = Processing(self.cfg.min_p, self.cfg.repetition_penalty)
        if isinstance(mb, Batch):
            return completion_logprobs(self.model, mb, with_entropy=with_entropy, proc=proc)
        return packed_completion_logprobs(self.model, mb, with_entropy=with_entropy, proc=proc)

    def adapter_is_finite(self) -> bool:
        """No NaN or inf in any LoRA weight (checked before every push and save)."""
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters() if p.requires_grad)

    def logprobs(self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float) -> list[float]:
        self.model.eval()
        return sequence_logprobs(self.model, list(prompt_ids), list(completion_ids), temperature)

    def save_adapter(self, path: str | Path) -> Path:
        """The adapter in standard peft format (adapter_config.json + adapter_model.safetensors)."""
        path = Path(path)
        self.model.save_pretrained(path, safe_serialization=True)
        return path

    def state_dict(self) -> dict:
        """Optimizer, scheduler and policy version: with the adapter (`save_adapter`), the trainer's whole state."""
        return {"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "version": self.version}

    def load_state(self, adapter_dir: str | Path, state: dict) -> None:
        """Continue from a checkpoint: the adapter saved in `adapter_dir` (copied into the live LoRA tensors, so
        the flat adapter buffer stays shared) and `state_dict()`'s output."""
        res = set_peft_model_state_dict(self.model, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
        if getattr(res, "unexpected_keys", None):
            raise ValueError(f"{adapter_dir}: the adapter does not fit this model (unexpected {res.unexpected_keys[:3]})")
        self.opt.load_state_dict(state["opt"])
        self.sched.load_state_dict(state["sched"])
        self.version = state["version"]
