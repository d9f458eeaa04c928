"""`ppo_epochs` > 1: several optimizer steps on one batch are still one trainer step. The adapter's version moves by
one per step (the pipeline's depth bound counts versions: at 2 per step, K = 0 let the next step's generation start
during training, on the very model being trained: "element 0 of tensors does not require grad" on the demo with
ppo_epochs: 2), staleness stays 0 at K = 0, and the schedule is in run steps."""
import pytest
from conftest import TOY_ROWS

from minirl import Config, Run


def _run(tiny_model, out, **kw):
    cfg = Config(model=tiny_model, backend="hf", data="unused", rewards=["yes_reward"], steps=4, prompts_per_step=4,
                 group_size=4, max_tokens=6, lr=1e-2, eval_size=4, out_dir=str(out), lora_rank=8, lora_alpha=16,
                 lr_schedule="cosine", **{"max_async_steps": 0, **kw})
    run = Run(cfg, data=TOY_ROWS[:40], eval_data=TOY_ROWS[40:44])
    run.run()
    return run


@pytest.fixture(scope="module")
def two_epochs(tiny_model, tmp_path_factory):
    return _run(tiny_model, tmp_path_factory.mktemp("e2"), ppo_epochs=2)


def test_two_epochs_train_every_step_synchronously(two_epochs):
    h = two_epochs.history
    assert len(h) == 4 and sum(x["train/samples"] > 0 for x in h) >= 2  # steps train (the reward has a spread)
    assert [x["version"] for x in h] == [1, 2, 3, 4]
    assert all((x.get("staleness/max") or 0) == 0 for x in h)  # K = 0: each step sampled by the previous adapter


def test_the_schedule_counts_run_steps_not_epochs(two_epochs, tiny_model, tmp_path):
    one = _run(tiny_model, tmp_path / "e1")
    both = [(a["lr"], b["lr"]) for a, b in zip(two_epochs.history, one.history) if "lr" in a and "lr" in b]
    assert len(both) >= 2 and len({a for a, _ in both}) >= 2  # steps that trained, at different rates
    assert [a for a, _ in both] == pytest.approx([b for _, b in both])
