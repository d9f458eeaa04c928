"""Issue 54 item 3: a sequence-classification reward model as a reward (`reward_model(path=...)`), with a small
classifier built in code from the tiny model (its score head random, seeded)."""
import pytest
import torch
from conftest import TOY_ROWS

from minirl.rewards import Scorer
from minirl.rewards.reward_model import reward_model


def _classifier(tiny_model, folder, num_labels=1, labels=None):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    torch.manual_seed(0)
    kw = dict(id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)}) if labels else {}
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model, num_labels=num_labels, **kw)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(folder)
    return str(folder), model.eval()


def _by_hand(model, tiny_model, prompt, completion, col=0):
    """One text alone (no padding): the head's logit at its last token."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                                   tokenize=False)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        return float(model(**ids).logits[0, col])


def test_scores_are_the_heads_logit_of_each_text_batched_with_padding(tiny_model, tmp_path):
    path, model = _classifier(tiny_model, tmp_path / "rm")
    prompts = ["What is 1 + 2 ?"] * 3
    completions = ["3", "the answer is 3 yes", "no no no 4 a b"]  # different lengths: padded in one batch
    got = reward_model(prompts, completions, path=path, batch_size=3)
    want = [_by_hand(model, tiny_model, p, c) for p, c in zip(prompts, completions)]
    assert got == pytest.approx(want, abs=1e-5) and len(set(round(x, 4) for x in got)) == 3
    assert reward_model(prompts, completions, path=path, batch_size=1) == pytest.approx(want, abs=1e-5)
    msgs = reward_model([[{"role": "user", "content": prompts[0]}]], [[{"role": "assistant", "content": "3"}]],
                        path=path)  # conversational data: message lists as they are
    assert msgs == pytest.approx(want[:1], abs=1e-5)


def test_a_label_picks_its_logit_and_several_labels_need_one(tiny_model, tmp_path):
    path, model = _classifier(tiny_model, tmp_path / "rm2", 2, ["bad", "good"])
    good = reward_model(["What is 1 + 2 ?"], ["3"], path=path, label="good")
    assert good == pytest.approx([_by_hand(model, tiny_model, "What is 1 + 2 ?", "3", col=1)], abs=1e-5)
    assert reward_model(["What is 1 + 2 ?"], ["3"], path=path, label=1) == good
    with pytest.raises(ValueError, match=r"has 2 labels \['bad', 'good'\]: give label="):
        reward_model(["q"], ["a"], path=path)
    with pytest.raises(ValueError, match="label 'great' is not one of"):
        reward_model(["q"], ["a"], path=path, label="great")


def test_named_in_rewards_it_scores_each_group_in_a_worker(tiny_model, tmp_path, toy_cfg):
    """`rewards: ["reward_model(path=...)"]` through the scorer's worker process (its own copy of the model), the
    same scores as in this process; then a run trains 2 steps on it."""
    from minirl import Run
    from minirl.types import Completion, Group, Prompt
    path, _ = _classifier(tiny_model, tmp_path / "rm")
    ref = f"reward_model(path={path!r})"
    group = Group(Prompt(0, (1, 2), "What is 1 + 2 ?", {"answer": 3}),
                  tuple(Completion((5,), (-1.0,), (0,), t, "stop") for t in ("3", "4 yes")))
    scorer = Scorer.from_config([ref], None, 60.0, workers=1)
    try:
        scored = scorer.score_group(group)
    finally:
        scorer.close()
    assert scored.failures == () and scored.rewards == pytest.approx(reward_model([group.prompt.text] * 2, ["3", "4 yes"],
                                                                                  path=path), abs=1e-5)
    run = Run(toy_cfg.replace(rewards=[ref], reward_workers=0, eval_size=0), data=TOY_ROWS[:16])
    assert run.run()["steps"] == 2
    assert all(h["reward/failures"] == 0 and h[f"reward/{ref}"] == h["reward/mean"] for h in run.history), run.history
