"""The token X-ray's trainer side: `XrayProbe` copies the per-token terms of a few chosen completions off the
tensors the step already has (no extra forward pass): the completions `metrics.sample_rows` logs, the first of each
of the first `n` groups.

The probe is shown each micro-batch of the step's last epoch (`see`): the rows it wants are sliced out of that
micro-batch's `LossInputs` (trainer logprobs of that epoch, the proximal logprobs of the first, the behaviour's,
the step-wide weights) and `loss.token_terms` runs on them alone, without gradient. With ppo_epochs 1 that epoch is
the first: the ratio is 1 and the clip cannot bind; the IS weight and the mismatch show the off-policy gap. The
terms are the built-in loss's; a custom loss_fn's own choices are not seen. Packing and micro-batching only move
rows: each keeps its sample index (`Batch.index_B`), so the records do not depend on them.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from minirl.core.xray import TokenXray, sig
from minirl.training.batch import Sample, SampleFilter
from minirl.training.loss import LossInputs, token_terms
from minirl.types import ScoredGroup

PER_ROW = ("logp_B_T", "old_logp_B_T", "behav_logp_B_T", "weight_B_T", "mask_B_T", "ref_logp_B_T", "entropy_B_T",
           "top_entropy_B_T")


def _note(reason: str | None) -> str:
    """A record's note until the step trains it (then ""): not trained, and why (`SampleFilter.skip_reason`)."""
    return "not trained" if reason is None else f"not trained: {reason}"


class XrayProbe:
    """Collects `records`: one `TokenXray` per chosen completion, in `sample_rows`' order."""

    def __init__(self, groups: Sequence[ScoredGroup], samples: Sequence[Sample], n: int, tokenizer, version: int,
                 keep: SampleFilter):
        """`keep`: the filter that chose `samples` (an untrained completion's note names its reason)."""
        self.samples = samples
        by_origin = {s.origin: i for i, s in enumerate(samples)}
        self.want: dict[int, int] = {}  # sample index -> position in records
        self.records: list[TokenXray] = []
        for k, g in enumerate(groups[:max(0, n)]):
            c = g.group.completions[0]
            mask = c.mask if c.mask is not None else (True,) * len(c.token_ids)
            self.records.append(TokenXray(
                tuple(c.token_ids), tuple(tokenizer.batch_decode([[t] for t in c.token_ids])), tuple(map(int, mask)),
                tuple(c.versions), tuple(sig(x) for x in c.logprobs), weight_T=(0.0,) * len(c.token_ids),
                advantage=sig(g.advantages[0]) if g.advantages else 0.0, trainer_version=version,
                note=_note(keep.skip_reason(c, g.rewards[0], g.advantages[0]))))
            if (i := by_origin.get((k, 0))) is not None:
                self.want[i] = k

    def see(self, inp: LossInputs, index_B: torch.Tensor | None) -> None:
        """Take the wanted rows of one micro-batch (`index_B`: each row's sample index)."""
        if not self.want or index_B is None:
            return
        hits = [(r, i) for r, i in enumerate(index_B.tolist()) if i in self.want]
        if not hits:
            return
        with torch.no_grad():
            sel = torch.tensor([r for r, _ in hits], device=inp.adv_B.device)
            sub = dataclasses.replace(inp, adv_B=inp.adv_B[sel], **{
                k: v[sel].detach() for k in PER_ROW if (v := getattr(inp, k)) is not None})
            t = token_terms(sub)
            mask = sub.mask_B_T.bool()
            codes = {"trunc": (t.is_raw > sub.settings.tis_cap) & ~t.band if sub.settings.tis_cap is not None
                     else None, "band": t.band, "behav": t.out, "opsm": t.drop & ~t.out,
                     "entropy": None if sub.top_entropy_B_T is None else ~sub.top_entropy_B_T.bool()}
            flags = {k: (v & mask).cpu() for k, v in codes.items() if v is not None}
            old, behav = sub.old_logp_B_T.float().cpu(), sub.behav_logp_B_T.float().cpu()
            cols = {"ratio": t.ratio.float().cpu(), "is_w": t.is_w.float().cpu(),
                    "clipped": (t.clipped & mask).cpu(), "w": (sub.weight_B_T * sub.adv_B[:, None]).float().cpu()}
        mask = mask.cpu()
        for j, (_, i) in enumerate(hits):
            s = self.samples[i]
            p = len(s.prompt_ids)
            span = slice(p, p + len(s.completion_ids))
            on = mask[j, span].tolist()

            def vals(x: torch.Tensor, off: float = 0.0) -> tuple[float, ...]:  # environment tokens: `off`
                return tuple(sig(v) if m else off for v, m in zip(x[j, span].tolist(), on))
            fl = {c: f[j, span].tolist() for c, f in flags.items()}
            k = self.want.pop(i)
            self.records[k] = dataclasses.replace(
                self.records[k], trainer_logp_T=vals(old), mismatch_T=vals(old - behav),
                ratio_T=vals(cols["ratio"], 1.0), is_weight_T=vals(cols["is_w"]),
                clipped_T=tuple(int(v) for v in cols["clipped"][j, span].tolist()),
                masked_T=tuple("+".join(c for c, f in fl.items() if f[t]) for t in range(len(on))),
                weight_T=vals(cols["w"]), advantage=sig(s.advantage), note="")
