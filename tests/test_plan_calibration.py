"""The memory plan against measured peaks (issue 36 item 4): the predicted INCREASE of the training phase's peak
between token budgets is within +-25 % of the measured increase. Only differences are compared, so an offset fitted
to one point cannot pass; what is checked is the plan's per-token figure (activations + the logits chunk)."""
import json
from pathlib import Path

import pytest

from minirl.config import DEMO, Config
from minirl.plan import Shape, plan_shape

DATA = Path(__file__).parent / "data" / "memory_budgets.json"


@pytest.mark.xfail(strict=True, reason="not calibrated yet: on the recorded rows the plan predicts +778 MB (512 -> "
                   "1024) and +5558 MB (512 -> 4096) where +1970 and +7964 MB were measured; the per-token count "
                   "of kept tensors (plan.Shape.layer_activation_bytes) is too low for float32 on CPU")
def test_predicted_increase_of_the_training_peak_between_budgets_within_25_percent():
    """tests/data/memory_budgets.json: one trainer step of the demo's shape (the embedded model, float32, CPU,
    packing 'padded') at token budgets 512, 1024 and 4096, each in a fresh process (`command` in the file says
    how it was recorded). The plan is given each row's largest micro-batch (padded tokens), as the trainer cut it."""
    rec = json.loads(DATA.read_text())
    shape = Shape.from_config(rec["model_config"])
    cfg = Config(**{**DEMO, "backend": "hf", "packing": "padded"})
    rows = {r["token_budget"]: r for r in rec["rows"]}

    def predicted_mb(row):
        p = plan_shape(cfg.replace(token_budget=row["micro_tokens"]), shape, "cpu", None,
                       gradient_checkpointing=False, prompt_tokens=rec["prompt_tokens"])
        return (p.train["activations"] + p.train["logits"]) * 1024

    base = rows[512]
    for hi in (1024, 4096):
        want = rows[hi]["train_rss_mb"] - base["train_rss_mb"]
        got = predicted_mb(rows[hi]) - predicted_mb(base)
        assert want > 0 and abs(got - want) <= 0.25 * want, (hi, round(got), round(want))
