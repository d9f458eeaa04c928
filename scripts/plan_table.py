"""The memory plan's table for the published shapes on common GPUs (docs/gpu.md, "the plan's table").

`Config()` defaults with `max_tokens: 512`, `backend: vllm` colocated on one GPU (the engine sleeps while the trainer
works, as a run on one GPU plans), bfloat16; each shape's config.json from `minirl/shapes/`, no weights.

    python scripts/plan_table.py > table.md
"""
import json
import tempfile
from pathlib import Path

from minirl import Config
from minirl.training.plan import plan_shape, Shape
from minirl.training.shapes.synthetic import shape_config

MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
GPUS = (24, 48, 80)


def main() -> None:
    print("| model | GPU | fits | peak GiB (train / generate) | token_budget | checkpointing | 4-bit | engine share |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            d = Path(tmp) / name
            d.mkdir()
            (d / "config.json").write_text(json.dumps(shape_config(name)))
            cfg = Config(model=str(d), backend="vllm", max_tokens=512)
            for gb in GPUS:
                p = plan_shape(cfg, Shape.from_config(shape_config(name)), "cuda", gb, engine_sleeps=True)
                print(f"| {name} | {gb} GB | {'yes' if p.fits else 'no'} | {p.train_gb:.1f} / {p.generate_gb:.1f} | "
                      f"{p.token_budget} | {'on' if p.gradient_checkpointing else 'off'} | "
                      f"{'yes' if p.load_in_4bit else 'no'} | {p.gpu_memory_utilization} |")


if __name__ == "__main__":
    main()
