"""Read, from a vLLM wheel's source (never imported), what minirl's hooks touch, into a fixture for
tests/test_vllm_hooks.py: for each class the hooks reach (worker, model runners V1 and V2, LoRA managers, request
states, the scheduler's output), its module, its bases (resolved through the file's imports), the parameters of
the hooked methods ('name', 'name=' with a default, '*a', '**kw') and which hooked attributes it assigns
(`self.x = ...`) or declares (dataclass fields).

    python -m pip download vllm==0.34.0 --no-deps -d /tmp/vllm
    PYTHONPATH=. python scripts/vllm_hook_fixture.py /tmp/vllm/vllm-0.34.0-*.whl > tests/data/vllm_hooks_0.34.0.json
"""
from __future__ import annotations

import ast
import json
import sys
import zipfile

from minirl.sync.vllm_compat import CLASSES, HOOKS, RUNNER_HOOKS

# where each class the hooks reach is defined, as `path:Class` (absent files are left out: 0.34 has no V1 runner)
ROOTS = ("vllm/v1/worker/gpu_worker.py:Worker", "vllm/v1/worker/cpu_worker.py:CPUWorker",
         "vllm/v1/worker/gpu_model_runner.py:GPUModelRunner", "vllm/v1/worker/cpu_model_runner.py:CPUModelRunner",
         "vllm/v1/worker/gpu/model_runner.py:GPUModelRunner", "vllm/v1/worker/cpu/model_runner.py:CPUModelRunner",
         "vllm/lora/worker_manager.py:LRUCacheWorkerLoRAManager", "vllm/lora/model_manager.py:LRUCacheLoRAModelManager",
         "vllm/v1/worker/gpu/states.py:RequestState", "vllm/v1/worker/gpu/lora_utils.py:LoraState",
         *(f"{mod.replace('.', '/')}.py:{name}" for name, mod in CLASSES.items()))
NAMES = {name for _, name, _, _ in HOOKS + sum(RUNNER_HOOKS.values(), ())}


def params(fn: ast.FunctionDef) -> list[str]:
    a = fn.args
    pos = a.posonlyargs + a.args
    out = [p.arg + ("=" if i >= len(pos) - len(a.defaults) else "") for i, p in enumerate(pos)]
    out += [f"*{a.vararg.arg}"] if a.vararg else []
    out += [p.arg + ("=" if d is not None else "") for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    return [p for p in out + ([f"**{a.kwarg.arg}"] if a.kwarg else []) if p != "self"]


def read_class(src: dict[str, str], path: str, name: str, out: dict) -> str | None:
    """Add `path:name` and its bases to `out`; returns its key, None when its file is not in the wheel."""
    key = f"{path}:{name}"
    if key in out:
        return key
    if path not in src:
        return None
    tree = ast.parse(src[path])
    imported = {a.asname or a.name: n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
                for a in n.names}
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is None:
        return None
    entry = out[key] = {"module": path.removesuffix(".py").removesuffix("/__init__").replace("/", "."), "name": name,
                        "bases": [], "methods": {}, "attrs": []}
    for b in cls.bases:
        base = ast.unparse(b).split("[")[0]
        where = path if any(isinstance(n, ast.ClassDef) and n.name == base for n in tree.body) else \
            imported.get(base, "").replace(".", "/") + ".py"
        got = read_class(src, where, base, out)
        if got is not None:
            entry["bases"].append(got)
    attrs = set()
    for n in cls.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in NAMES:
            entry["methods"][n.name] = params(n)
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            attrs.add(n.target.id)  # a dataclass field / class annotation
    for n in ast.walk(cls):
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        attrs |= {t.attr for t in targets if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}
    entry["attrs"] = sorted(attrs & NAMES)
    return key


def main(wheel: str) -> dict:
    with zipfile.ZipFile(wheel) as z:
        src = {n: z.read(n).decode() for n in z.namelist() if n.startswith("vllm/") and n.endswith(".py")}
    version = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    out: dict = {}
    roots = [read_class(src, *r.split(":"), out) for r in ROOTS]
    worker_src = src["vllm/v1/worker/gpu_worker.py"]
    return {"version": version.split("/")[0].removeprefix("vllm-").removesuffix(".dist-info"),
            "roots": {r: k for r, k in zip(ROOTS, roots) if k is not None},
            "runners_in_gpu_worker": {"V1": "vllm.v1.worker.gpu_model_runner" in worker_src,
                                      "V2": "vllm.v1.worker.gpu.model_runner" in worker_src},
            "classes": out}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=1, sort_keys=True))
