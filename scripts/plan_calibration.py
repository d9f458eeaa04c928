"""The training phase's peak memory at several token budgets, for the memory plan's calibration test.

Each budget in a fresh process (a peak is per process): the demo's trainer (the embedded model, float32, CPU,
packing 'padded'), one `Trainer.step` on a fixed batch shaped like the demo's step (8 prompts x 8 completions,
45-token prompts, 24-token completions, every advantage non-zero), peak resident memory of the step measured as
`minirl bench memory` measures its `train` phase (VmHWM reset at the step's start). Generation is left out: it is
what makes a `bench memory` row slow, and the plan's calibration compares the training phase only.

    python scripts/plan_calibration.py 512,1024,4096 > tests/data/memory_budgets.json
"""
import json
import subprocess
import sys

PROMPT, COMPLETION, P, G = 45, 24, 8, 8


def one(budget: int) -> dict:
    import random
    from minirl.benchmarks.memory import micro_tokens
    from minirl.config import DEMO, Config
    from minirl.metrics import memory_metrics
    from minirl.trainer import Trainer
    from minirl.types import Completion, Group, Prompt, ScoredGroup
    cfg = Config(**{**DEMO, "token_budget": budget, "packing": "padded"})
    trainer = Trainer(cfg, device="cpu")
    rng = random.Random(0)
    groups = []
    for p in range(P):
        prompt = Prompt(p, tuple(rng.randrange(100, 40000) for _ in range(PROMPT)), "")
        comps = tuple(Completion(tuple(rng.randrange(100, 40000) for _ in range(COMPLETION)), (-1.0,) * COMPLETION,
                                 (0,) * COMPLETION, "", "length") for _ in range(G))
        adv = tuple((-1.0) ** i * (0.5 + 0.1 * i) for i in range(G))
        groups.append(ScoredGroup(Group(prompt, comps), (1.0,) * G, {}, adv))
    micro = micro_tokens(trainer, groups)
    memory_metrics()  # the step's window starts here
    m = trainer.step(groups)
    return {"token_budget": budget, "train_rss_mb": round(m["mem/rss_mb"], 1), "micro_tokens": micro,
            "micro_batches": m["train/micro_batches"], "train_tokens": m["train/tokens"]}


def main() -> None:
    if sys.argv[1] == "--one":
        print(json.dumps(one(int(sys.argv[2]))))
        return
    rows = []
    for b in (int(x) for x in sys.argv[1].split(",")):
        out = subprocess.run([sys.executable, __file__, "--one", str(b)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    from minirl.models import resolve_model
    from pathlib import Path
    config = json.loads((Path(resolve_model("smollm2-135m-instruct")) / "config.json").read_text())
    print(json.dumps({"command": "python scripts/plan_calibration.py " + sys.argv[1], "prompt_tokens": PROMPT,
                      "completion_tokens": COMPLETION, "model_config": config, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
