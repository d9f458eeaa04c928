"""docs/gpu.md's plan blocks, written from `minirl plan` itself: the CLI's output for three configs (verbatim, the
temporary model folder's prefix left out) and a table of the published shapes on one and two GPUs from
`minirl.plan`, the function the CLI prints. Each config: `Config()` defaults with `backend: vllm` (the four-GPU
example: `auto`) and `max_tokens: 512`, the shape's config.json from `minirl/shapes/` (no weights); the GPUs are
faked (`--gpus`, `--gpu-gb`), so the blocks are the same on any machine. tests/test_docs_generated.py fails when
they are stale.

    python scripts/plan_table.py           # rewrite the blocks in docs/gpu.md
    python scripts/plan_table.py --check   # exit 1 if they are stale
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "gpu.md"
MODELS = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
SETUPS = ((1, 24), (1, 48), (1, 80), (2, 24), (2, 48))  # (GPUs, GB each)
EXAMPLES = {"plan-1gpu": ("qwen2.5-1.5b", 1, 24, "vllm"), "plan-2gpu": ("qwen2.5-7b", 2, 24, "vllm"),
            "plan-4gpu": ("qwen2.5-7b", 4, 24, "auto")}  # (shape, GPUs, GB each, backend)
YAML = "model: {model}\nbackend: {backend}\nmax_tokens: 512\n"


def _yaml(tmp: Path, name: str, backend: str = "vllm") -> Path:
    from minirl.training.shapes.synthetic import shape_config
    (tmp / name).mkdir(exist_ok=True)
    (tmp / name / "config.json").write_text(json.dumps(shape_config(name)))
    (tmp / f"{name}.yaml").write_text(YAML.format(model=tmp / name, backend=backend))
    return tmp / f"{name}.yaml"


def cli(tmp: Path, name: str, gpus: int, gb: int, backend: str) -> str:
    """`minirl plan NAME.yaml --gpus GPUS --gpu-gb GB` (NAME.yaml: `backend: BACKEND`), as printed."""
    from minirl.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", str(_yaml(tmp, name, backend)), "--gpus", str(gpus), "--gpu-gb", str(gb)]) == 0
    return out.getvalue().replace(f"{tmp}/", "")


def table(tmp: Path) -> str:
    import minirl
    rows = ["| model | GPUs | fits | trainer's GPU GiB (train / generate) | engine's GPU GiB | token_budget | "
            "4-bit | engine share |", "|---|---|---|---|---|---|---|---|"]
    for name in MODELS:
        cfg = minirl.Config.from_yaml(_yaml(tmp, name))
        for gpus, gb in SETUPS:
            p = minirl.plan(cfg, gpu_gb=gb, gpus=gpus)
            t = p.trainer
            engine = next(d for d in p.devices if "vLLM" in d.role)
            apart = "" if engine is t else f"{engine.peak_gb:.1f}"
            rows.append(f"| {name} | {gpus} x {gb} GB | {'yes' if p.fits else 'no'} | {t.train_gb:.1f} / "
                        f"{t.generate_gb:.1f} | {apart or '(shared)'} | {t.token_budget} | "
                        f"{'yes' if t.load_in_4bit else 'no'} | {engine.gpu_memory_utilization} |")
    return "\n".join(rows)


def blocks() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        out = {k: "\n".join(f"    {x}".rstrip() for x in
                            [f"$ minirl plan {m}.yaml --gpus {n} --gpu-gb {g}        # backend: {b}",
                             *cli(tmp, m, n, g, b).splitlines()])
               for k, (m, n, g, b) in EXAMPLES.items()}
        out["plan-table"] = table(tmp)
    return out


def render(text: str, made: dict[str, str]) -> str:
    for k, v in made.items():
        pattern = re.compile(rf"(<!-- {k} -->).*?(<!-- /{k} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"docs/gpu.md has no <!-- {k} --> ... <!-- /{k} --> block")
        text = pattern.sub(lambda m: m.group(1) + "\n\n" + v + "\n\n" + m.group(2), text)
    return text


def stale() -> bool:
    text = PAGE.read_text()
    return render(text, blocks()) != text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    if ap.parse_args().check:
        if stale():
            print("docs/gpu.md's plan blocks are stale: run python scripts/plan_table.py")
            return 1
        return 0
    PAGE.write_text(render(PAGE.read_text(), blocks()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
