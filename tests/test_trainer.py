"""Trainer: micro-batching exactness, logprob computation, and learning on a tiny model."""
import pytest
import torch
from conftest import TOY_ROWS

from minirl import Config, Run
from minirl.training.batch import Sample, completion_logprobs, make_batch
from minirl.training.trainer import Trainer


def _samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = torch.randint(5, 60, (3 + i % 3,), generator=g).tolist()
        c = torch.randint(5, 60, (2 + (i * 2) % 5,), generator=g).tolist()
        lp = (-torch.rand(len(c), generator=g) * 3).tolist()
        out.append(Sample(tuple(p), tuple(c), tuple(lp), (0,) * len(c), float(i % 3) - 1.0))
    return out


def _grads(trainer, batch, budget):
    trainer.model.zero_grad(set_to_none=True)
    from minirl.training.loss import policy_loss
    for mb in batch.micro_batches(budget):
        logp, _ = completion_logprobs(trainer.model, mb, 1.0)
        out = policy_loss(logp, logp.detach(), mb.behav_logp_B_L, mb.adv_B, mb.weight_B_L, mb.tgt_mask_B_L)
        out.loss.backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean", "constant"])
def test_token_budget_micro_batches_match_full_batch(tiny_model, agg):
    cfg = Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8, token_budget=8)
    tr = Trainer(cfg)
    with torch.no_grad():  # make LoRA B non-zero so every LoRA weight gets a gradient
        for n, p in tr.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    batch = make_batch(_samples(), pad_id=0, agg=agg, max_tokens=8)
    full = _grads(tr, batch, budget=10_000)
    mbs = list(batch.micro_batches(16))
    assert len(mbs) > 2  # really split
    split = _grads(tr, batch, budget=16)
    assert full.keys() == split.keys() and full
    for n in full:
        torch.testing.assert_close(split[n], full[n], rtol=1e-4, atol=1e-6)


def test_completion_logprobs_match_full_logits(tiny_model):
    cfg = Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8)
    tr = Trainer(cfg)
    s = _samples(2)
    batch = make_batch(s, pad_id=0, agg="token-mean", max_tokens=8)
    with torch.no_grad():
        lp, ent = completion_logprobs(tr.model, batch, temperature=0.7, with_entropy=True)
        logits = tr.model(input_ids=batch.input_ids_B_L, attention_mask=batch.attn_B_L).logits.float() / 0.7
    ref = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids_B_L[:, 1:, None]).squeeze(-1)
    m = batch.tgt_mask_B_L[:, 1:]
    torch.testing.assert_close(lp[:, 1:][m], ref[m], rtol=1e-4, atol=1e-5)
    assert ent > 0


def test_reward_rises_on_toy_task(toy_cfg):
    """Learning: on a tiny random model, the share of completions saying 'yes' rises clearly (seeded)."""
    cfg = toy_cfg.replace(steps=30, prompts_per_step=4, group_size=8, max_tokens=6, lr=2e-2, lora_alpha=16, eval_size=16)
    run = Run(cfg, data=TOY_ROWS[:48], eval_data=TOY_ROWS[48:])
    s = run.run()
    r = [h["reward/mean"] for h in run.history]
    first, last = sum(r[:5]) / 5, sum(r[-5:]) / 5
    assert last > first + 0.12 and last > 1.8 * first, (first, last)
    assert s["eval_accuracy_after"] >= s["eval_accuracy_before"] + 0.5, s  # held-out prompts, same reward


def test_each_row_is_scored_at_the_temperature_it_was_sampled_at(tiny_model):
    """A batch mixing groups sampled before and after `Run.set(temperature=...)` (K >= 1): every row's logprobs
    are taken at its own sampling temperature, not at the run's current one."""
    import dataclasses
    tr = Trainer(Config(model=tiny_model, backend="hf", lora_rank=4, max_tokens=8))
    a, b = _samples(2)
    batch = make_batch([dataclasses.replace(a, temperature=0.5), dataclasses.replace(b, temperature=1.5)],
                       pad_id=0, agg="token-mean", max_tokens=8)
    with torch.no_grad():
        mixed, _ = completion_logprobs(tr.model, batch)
        at = {t: completion_logprobs(tr.model, batch, temperature=t)[0] for t in (0.5, 1.5)}
    m = batch.tgt_mask_B_L
    torch.testing.assert_close(mixed[0][m[0]], at[0.5][0][m[0]])
    torch.testing.assert_close(mixed[1][m[1]], at[1.5][1][m[1]])
    assert not torch.allclose(at[0.5][1][m[1]], at[1.5][1][m[1]])  # the temperature matters for these rows
