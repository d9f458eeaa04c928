"""The token X-ray (issue 54 item 5): each logged sample's per-token record as the trainer's step computed it
(hand-checked on an off-policy batch and on a second epoch, unchanged by packing and micro-batching), its views
(HTML with hover, table, PNG, CLI) from a saved run, and the dashboard's samples panel offering it."""
import json
import math
from pathlib import Path

import pytest
import torch
from conftest import TOY_ROWS
from test_packing import DATA

import minirl
from minirl import Config, Run
from minirl.benchmarks.trainer_step import load_batches
from minirl.cli import main
from minirl.core.metrics import sample_rows
from minirl.core.xray import TokenXray
from minirl.training.batch import SampleFilter, samples_from_groups
from minirl.training.trainer import Trainer
from minirl.training.xray import XrayProbe
from minirl.types import Completion, Group, Prompt, ScoredGroup
from minirl.ui import Dashboard

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run_dir(tiny_model, tmp_path_factory):
    """A 2-step toy run with two PPO epochs (ratios move in the second), 4 logged samples a step."""
    out = tmp_path_factory.mktemp("xray") / "run"
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=2, prompts_per_step=4,
                 group_size=4, max_tokens=6, lr=1e-2, eval_size=4, out_dir=str(out), lora_rank=8, lora_alpha=16,
                 seed=0, ppo_epochs=2, log_samples=4)
    Run(cfg, data=TOY_ROWS[:48], eval_data=TOY_ROWS[48:]).run()
    return out


def _samples_events(out: Path) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["event"] == "samples"]


def test_each_logged_sample_carries_its_token_xray(run_dir):
    events = _samples_events(run_dir)
    assert [e["step"] for e in events] == [0, 1]
    trained = 0
    for e in events:
        assert len(e["samples"]) == 4
        for row in e["samples"]:
            x = TokenXray.from_row(row["xray"])
            n = len(x.token_ids_T)
            assert n > 0 and len(x.pieces_T) == len(x.loss_mask_T) == len(x.version_T) == len(x.behav_logp_T) == n
            assert len(x.weight_T) == n and x.advantage == pytest.approx(row["advantage"], rel=1e-3, abs=1e-4)
            if x.trained:
                trained += 1
                for name in ("trainer_logp_T", "mismatch_T", "ratio_T", "is_weight_T", "clipped_T", "masked_T"):
                    assert len(getattr(x, name)) == n, name
                assert any(abs(r - 1) > 1e-3 for r in x.ratio_T)  # the second epoch moved the policy
                assert all(w * x.advantage > 0 for w in x.weight_T)  # every token pushed the advantage's way
            else:
                assert "not trained" in x.note and not any(x.weight_T)
    assert trained >= 1


def test_views_read_a_saved_run(run_dir, tmp_path):
    x = minirl.xray(run_dir)  # the last logged step, its first sample
    assert x.step == 1 and x.sample == 0
    last = _samples_events(run_dir)[-1]["samples"][0]
    assert list(x.record.token_ids_T) == last["xray"]["token_ids"]
    step, k, row = next((e["step"], k, r) for e in _samples_events(run_dir) for k, r in enumerate(e["samples"])
                        if r["xray"]["trainer_logp"])
    y = minirl.xray(run_dir / "metrics.jsonl", step=step, sample=k)
    assert y.record.trained and (y.step, y.sample) == (step, k)
    h = y._repr_html_()
    for piece in y.record.pieces_T:
        assert f">{piece.replace('<', '&lt;').replace('>', '&gt;')}</span>" in h
    assert h.count("ratio pi/pi_prox") == len(y.record) and f"ratio pi/pi_prox {y.record.ratio_T[0]:.4g}" in h
    assert len(y.table()) == len(y.record) and y.table()[0]["ratio"] == y.record.ratio_T[0]
    assert y.save_png(tmp_path / "x.png").read_bytes()[:8] == PNG
    assert minirl.xray(row).record == y.record  # a samples row alone
    with pytest.raises(ValueError, match="no logged sample with a token X-ray at step 7"):
        minirl.xray(run_dir, step=7)
    with pytest.raises(ValueError, match="give sample= in 0..3"):
        minirl.xray(run_dir, sample=9)
    assert main(["xray", str(run_dir), "--step", "0", "--sample", "1", "--out", str(tmp_path / "x.html")]) == 0
    assert "token X-ray" in (tmp_path / "x.html").read_text()
    assert main(["xray", str(run_dir), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG


def test_the_dashboards_samples_panel_offers_the_xray(run_dir):
    dash = Dashboard(run_dir)
    try:
        picks = [v for _, v in dash.xray_pick.options if v is not None]
        assert picks[0] == (1, 0) and len(picks) == 8  # newest first: both steps' 4 logged samples
        assert dash.xray_box.value == ""
        dash.xray_pick.value = (0, 2)
        x = minirl.xray(run_dir, step=0, sample=2)
        assert dash.xray_box.value == x.html() and "token X-ray" in dash.xray_box.value
    finally:
        dash.close()


def _group(index, prompt, completions, advantages):
    return ScoredGroup(Group(Prompt(index, tuple(prompt), f"p{index}"), tuple(completions)),
                       tuple(float(a) for a in advantages), {}, tuple(float(a) for a in advantages))


SHIFT = (0.0, 0.5, 1.0, -0.3, -1.0, 0.2)  # trainer - behaviour logprob, per token
PROMPTS = ((7, 8, 9), (11, 12, 13, 14), (20, 21))
COMPS = ((30, 31, 32, 33, 34, 35), (40, 41, 42, 43, 44, 45), (50, 51, 52, 53, 54, 55), (24, 25, 26))
MASK1 = (True, True, False, False, True, True)  # an episode: tokens 2, 3 are the environment's


def _off_policy_groups(tr):
    """Three groups of two; each group's first completion is logged. Behaviour logprobs are the trainer's minus
    SHIFT (the second group's environment tokens have logprob 0, as episodes log them); the third group's
    advantages are zero."""
    def comp(p, c, mask=None, shift=SHIFT):
        lp = tr.logprobs(p, c, 1.0)
        behav = tuple(0.0 if mask and not mask[t] else lp[t] - shift[t] for t in range(len(c)))
        return Completion(c, behav, (0,) * len(c), "t", "stop", mask), lp
    (c0, lp0), (c1, lp1) = comp(PROMPTS[0], COMPS[0]), comp(PROMPTS[1], COMPS[1], MASK1)
    (c2, _), (c3, _) = comp(PROMPTS[2], COMPS[2]), comp(PROMPTS[0], COMPS[3], shift=(0.0,) * 3)
    groups = [_group(0, PROMPTS[0], [c0, c3], [1, -1]), _group(1, PROMPTS[1], [c1, c0], [-1, 1]),
              _group(2, PROMPTS[2], [c2, c2], [0, 0])]
    return groups, (lp0, lp1)


def _tiny(tiny_model, **kw):
    return Trainer(Config(model=tiny_model, backend="hf", lora_rank=8, lora_alpha=16, max_tokens=8, seed=0,
                          tis_cap=2.0, behav_clip=True, **kw))


def test_hand_computed_xray_of_an_off_policy_batch(tiny_model):
    """One epoch: ratio 1 and no clip; mismatch = SHIFT; IS weight min(exp(SHIFT), 2) with 'trunc' past the cap;
    behav_clip drops a positive-advantage token whose pi / pi_behav = exp(SHIFT) > 1.28 and a negative one's below
    0.8; weight = advantage / (every trained sampled token: token-mean); environment tokens and the zero-advantage
    sample carry nothing."""
    tr = _tiny(tiny_model)
    groups, (lp0, lp1) = _off_policy_groups(tr)
    m, (x0, x1, x2) = tr.step_xray(groups, 3)
    n = 6 + 3 + 4 + 6  # sampled tokens trained: c0, c3, c1 (4 of 6), c0 again
    assert m["train/tokens"] == n
    assert x0.trained and x0.note == "" and x0.advantage == 1.0 and x0.trainer_version == 0
    assert x0.pieces_T == tuple(tr.tokenizer.decode([t]) for t in COMPS[0])
    assert x0.trainer_logp_T == pytest.approx(lp0, abs=2e-3)
    assert x0.mismatch_T == pytest.approx(SHIFT, abs=2e-3)
    assert x0.ratio_T == pytest.approx((1.0,) * 6, abs=1e-3) and x0.clipped_T == (0,) * 6
    assert x0.is_weight_T == pytest.approx([min(math.exp(d), 2.0) for d in SHIFT], rel=2e-3)
    assert x0.masked_T == ("", "behav", "trunc+behav", "", "", "")
    assert x0.weight_T == pytest.approx((1 / n,) * 6, rel=1e-3)
    # the episode: negative advantage, tokens 2 and 3 the environment's
    assert x1.loss_mask_T == (1, 1, 0, 0, 1, 1) and x1.advantage == -1.0
    assert x1.mismatch_T == pytest.approx([d if m else 0.0 for d, m in zip(SHIFT, MASK1)], abs=2e-3)
    assert x1.masked_T == ("", "", "", "", "behav", "")  # exp(-1) < 0.8 is dropped; exp(-0.3) is an env token
    assert x1.weight_T == pytest.approx([-1 / n if m else 0.0 for m in MASK1], rel=1e-3)
    assert x1.ratio_T == pytest.approx((1.0,) * 6, abs=1e-3)
    assert not x2.trained and "zero advantage" in x2.note and x2.weight_T == (0.0,) * 6
    assert x2.behav_logp_T == pytest.approx(groups[2].group.completions[0].logprobs, abs=1e-3)
    assert "zero advantage" in minirl.xray(x2).html()


def test_second_epoch_ratio_and_clip_flags_by_hand(tiny_model):
    """ppo_epochs 2: the ratio is pi / pi_prox in the second epoch, pi being the policy after the first update
    (a twin trainer with ppo_epochs 1 gives it); the clip binds where the ratio leaves [0.8, 1.28] in the
    advantage's direction, and behav_clip tests pi / pi_behav = ratio * exp(SHIFT)."""
    tr, twin = _tiny(tiny_model, ppo_epochs=2, lr=0.05), _tiny(tiny_model, ppo_epochs=1, lr=0.05)
    groups, (lp0, _) = _off_policy_groups(tr)
    _, (x0, _, _) = tr.step_xray(groups, 3)
    twin.step(groups)
    lp_after = twin.logprobs(PROMPTS[0], COMPS[0], 1.0)
    ratio = [math.exp(a - b) for a, b in zip(lp_after, lp0)]
    assert x0.trainer_logp_T == pytest.approx(lp0, abs=2e-3)  # the proximal policy: the first epoch's
    assert x0.ratio_T == pytest.approx(ratio, rel=2e-3)
    assert any(abs(r - 1) > 0.05 for r in ratio)
    assert x0.clipped_T == tuple(int(r > 1.28) for r in ratio)  # advantage +1: only the upper clip binds
    assert any(x0.clipped_T)
    behav = [r * math.exp(d) > 1.28 for r, d in zip(ratio, SHIFT)]
    assert tuple("behav" in f for f in x0.masked_T) == tuple(behav)


def test_packing_and_micro_batches_leave_the_xray_unchanged(tiny_model):
    """A stored episode batch (environment tokens), two epochs: shared-prefix packing and the padded layout, one
    micro-batch or many, give the same records."""
    _, steps = load_batches(DATA / "trainer_batches_tiny_episodes.json")
    groups = steps[0]
    out = {}
    for packing, budget in (("padded", 10_000), ("padded", 40), ("shared-prefix", 10_000), ("shared-prefix", 40)):
        tr = Trainer(Config(model=tiny_model, backend="hf", lora_rank=8, lora_alpha=16, max_tokens=8, seed=0,
                            ppo_epochs=2, lr=1e-2, packing=packing, token_budget=budget))
        assert tr.packing == packing
        m, out[packing, budget] = tr.step_xray(groups, len(groups))
        assert (m["train/micro_batches"] > 1) == (budget == 40)
    ref = out["padded", 10_000]
    assert any(x.trained for x in ref) and any(0 in x.loss_mask_T for x in ref)
    assert any(abs(r - 1) > 1e-3 for x in ref for r in x.ratio_T)
    for key, recs in out.items():
        for a, b in zip(recs, ref):
            assert (a.token_ids_T, a.loss_mask_T, a.note, a.clipped_T, a.masked_T) == \
                (b.token_ids_T, b.loss_mask_T, b.note, b.clipped_T, b.masked_T), key
            for name in ("trainer_logp_T", "mismatch_T", "ratio_T", "is_weight_T", "weight_T"):
                assert getattr(a, name) == pytest.approx(getattr(b, name), rel=2e-3, abs=1e-4), (key, name)


def test_html_escapes_what_the_log_holds_and_marks_clip_and_masks():
    x = TokenXray((5, 6, 7), ("<script>", "a'b", "\n"), (1, 1, 0), (3, 3, 3), (-1.0, -2.0, 0.0),
                  (-1.1, -1.9, 0.0), (-0.1, 0.1, 0.0), (1.5, 0.5, 1.0), (0.9, 1.1, 0.0), (1, 0, 0),
                  ("", "behav", ""), (0.2, -0.1, 0.0), advantage=0.5, trainer_version=5)
    v = minirl.xray(x)
    h = v.html()
    assert "<script>" not in h and "&lt;script&gt;" in h and "a&#x27;b" in h
    assert h.count("border-bottom:3px solid #e08000") == 2  # the legend's and token 0's (clipped)
    assert h.count("text-decoration:line-through") == 2  # the legend's and token 1's (masked)
    assert "staleness 2" in v.hover(0) and "CLIPPED" in v.hover(0) and "masked: behav" in v.hover(1)
    assert "environment token" in v.hover(2)
    assert TokenXray.from_row(json.loads(json.dumps(x.to_row()))) == x
    assert torch.tensor(v.colour(0)).tolist()[1] > torch.tensor(v.colour(1)).tolist()[1]  # green up, red down


def test_the_header_names_the_sampling_version_and_the_trainers_apart():
    """One step off-policy (K = 1): tokens sampled by version 28, the step's trainer at 29. The header said
    "policy version 29" above a version column of 28s."""
    x = TokenXray((5, 6), ("a", "b"), (1, 1), (28, 28), (-1.0, -1.0), weight_T=(0.0, 0.0), advantage=0.0,
                  trainer_version=29, note="not trained: zero advantage")
    v = minirl.xray(x, step=29)
    for text in (v.text().splitlines()[0], v.html()):
        assert "sampled by policy version 28, trainer at version 29" in text and "policy version 29" not in text
    mixed = TokenXray((5, 6, 7), ("a", "b", "c"), (1, 0, 1), (3, 9, 4), (-1.0, 0.0, -1.0), weight_T=(0.0,) * 3,
                      trainer_version=5)
    assert "sampled by policy versions 3-4, trainer at version 5" in minirl.xray(mixed).text()


def test_sample_rows_attach_an_xray_only_to_the_completion_it_describes():
    """A stale record (another completion's tokens, e.g. a step that did not make X-rays) is never shown as this
    step's: the row then has no "xray"."""
    comps = [Completion((5, 6), (-1.0, -1.0), (0, 0), "a b", "stop"), Completion((7,), (-1.0,), (0,), "c", "stop")]
    groups = [_group(0, (1, 2), [comps[0]], [1.0]), _group(1, (3,), [comps[1]], [-1.0])]
    mine = TokenXray((5, 6), ("a", "b"), (1, 1), (0, 0), (-1.0, -1.0), weight_T=(0.0, 0.0))
    stale = TokenXray((8,), ("d",), (1,), (0,), (-1.0,), weight_T=(0.0,))
    rows = sample_rows(groups, 2, [mine, stale])
    assert rows[0]["xray"] == mine.to_row() and "xray" not in rows[1]
    assert all("xray" not in r for r in sample_rows(groups, 2))


class _PieceTok:
    def batch_decode(self, ids):
        return [f"<{i[0]}>" for i in ids]


def test_every_reason_the_batch_skips_a_completion_is_the_one_its_xray_names():
    """Each condition injected alone into a logged completion: `samples_from_groups` leaves it out and the x-ray's
    note names that condition; the config's flags lift the two optional ones."""
    ok = Completion((5, 6), (-0.1, -0.2), (0, 0), "ab", "stop")
    cases = {"its reward failed": (ok, None, 1.0), "empty completion": (Completion((), (), (), "", "stop"), 1.0, 1.0),
             "truncated by a length cap": (Completion((5, 6), (-0.1, -0.2), (0, 0), "ab", "length"), 1.0, 1.0),
             "zero advantage": (ok, 1.0, 0.0)}
    groups = [ScoredGroup(Group(Prompt(k, (1, 2), "p"), (c, ok)), (r, 1.0), {}, (a, -1.0))
              for k, (c, r, a) in enumerate(cases.values())]
    strict = SampleFilter.from_config(Config(mask_truncated=True))
    assert strict == SampleFilter(keep_zero_adv=False, drop_truncated=True)
    samples = samples_from_groups(groups, strict)
    assert [s.origin for s in samples] == [(k, 1) for k in range(len(cases))]  # every injected one left out
    probe = XrayProbe(groups, samples, len(groups), _PieceTok(), 0, strict)
    assert [x.note.split(" (")[0] for x in probe.records] == [f"not trained: {why}" for why in cases]
    lax = SampleFilter.from_config(Config(kl_coef=0.1))
    assert lax == SampleFilter(keep_zero_adv=True, drop_truncated=False)
    kept = {s.origin for s in samples_from_groups(groups, lax)}
    assert kept == {(2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)}
    assert [lax.skip_reason(*case) for case in cases.values()] == ["its reward failed", "empty completion", None, None]
    with pytest.raises(TypeError, match=r"takes a SampleFilter, not bool: pass SampleFilter\(keep_zero_adv="):
        samples_from_groups(groups, True)  # the old (keep_zero_adv, drop_truncated) call says what to pass
