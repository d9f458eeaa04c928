"""The import graph of minirl/ against the layers declared in docs/architecture.md: nothing imports upward or
sideways, no module imports itself through others, the seven layer rules hold, package faces hold no code, and imports
sit at the top of each module. Function-level imports count too. Private names of other packages, and methods
replaced on vLLM's objects in its worker, only in minirl/sync/vllm_compat.py."""
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "minirl"


def declared_layers() -> dict[str, int]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"```layers\n(.*?)```", text, re.S).group(1)
    return {name: i for i, line in enumerate(block.strip().splitlines()) for name in line.split()}


def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the minirl modules it imports (a name imported from a package counts as its submodule when
    there is one)."""
    edges = {}
    for mod, path in mods.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    found.add(sub if sub in mods else target)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        edges[mod] = {m for m in found if m in mods and m != mod}
    return edges


def component(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "minirl"


def cycles(nodes: set[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in set(edges.get(v, ())) & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def test_every_module_is_placed_in_a_layer():
    layers = declared_layers()
    missing = sorted({component(m) for m in modules()} - set(layers))
    assert not missing, f"place these in docs/architecture.md's layers block: {missing}"


def against_layers(edges: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                  if component(a) != component(b) and layers[component(b)] >= layers[component(a)])


def test_nothing_imports_upward_or_sideways():
    bad = against_layers(imports(modules()), declared_layers())
    assert not bad, "imports against the layers in docs/architecture.md:\n" + "\n".join(bad)


def test_no_import_circles_faces_counted():
    """No module reaches itself through imports, counting every module: a package's `__init__` is a module too."""
    mods = modules()
    found = cycles(set(mods), imports(mods))
    assert not found, f"import circles: {found}"


# The layers, one line each (docs/architecture.md): importer package -> what it must not reach, even through others.
RULES = {
    "the config imports nothing of the loss": ("minirl.config", ("minirl.training.loss",)),
    "rewards import nothing of training": ("minirl.rewards", ("minirl.training",)),
    "sync imports nothing of the generators": ("minirl.sync", ("minirl.generation",)),
    "training imports nothing of the generators": ("minirl.training", ("minirl.generation",)),
    "training imports nothing of sync": ("minirl.training", ("minirl.sync",)),
    "the generators import nothing of the run": ("minirl.generation", ("minirl.run",)),
    "the pipeline imports nothing of the run": ("minirl.pipeline", ("minirl.run",)),
}


def within(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def reach(start: str, edges: dict[str, set[str]]) -> dict[str, str]:
    """Every module `start` imports, directly or through others -> the module that imports it on the way."""
    seen, todo = {}, [start]
    while todo:
        m = todo.pop()
        for t in edges.get(m, ()):
            if t not in seen:
                seen[t] = m
                todo.append(t)
    return seen


def broken_rules(edges: dict[str, set[str]]) -> dict[str, list[str]]:
    out = {}
    for rule, (importer, banned) in RULES.items():
        hits = sorted(f"{m} -> ... {via} -> {t}" for m in edges if within(m, importer)
                      for t, via in reach(m, edges).items() if any(within(t, b) for b in banned))
        if hits:
            out[rule] = hits[:3]
    return out


def test_the_seven_layer_rules_hold():
    broken = broken_rules(imports(modules()))
    assert not broken, broken


def test_each_layer_rule_sees_a_planted_import():
    """Positive control, one per rule: an edge planted in a copy of the graph from a module of the importer to one
    of the banned modules (through an innocent middle module) breaks that rule and only that rule."""
    edges = imports(modules())
    for rule, (importer, banned) in RULES.items():
        src = next(m for m in sorted(edges) if within(m, importer))
        dst = next(m for m in sorted(edges) if within(m, banned[0]))
        planted = {**edges, src: edges[src] | {"minirl.types"}, "minirl.types": edges["minirl.types"] | {dst}}
        assert set(broken_rules(planted)) >= {rule}, rule


ROOT_MODULES_MAX = 8


def test_the_root_keeps_the_public_face_the_cli_and_the_shared_types():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules at minirl/'s root (at most {ROOT_MODULES_MAX}): {root}"


def code_in_face(tree: ast.Module) -> list[str]:
    """Statements of an `__init__.py` other than its docstring, imports (re-exports) and dunder names."""
    out = []
    for i, n in enumerate(tree.body):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            continue
        if i == 0 and isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant):
            continue
        if isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) and t.id.startswith("__") for t in n.targets):
            continue
        out.append(ast.unparse(n).splitlines()[0])
    return out


def test_package_faces_hold_no_code():
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("__init__.py")
             if (got := code_in_face(ast.parse(p.read_text())))}
    assert not found, f"move it to a named module: {found}"
    assert code_in_face(ast.parse('"""doc."""\nfrom a import b\n__all__ = ["b"]\nc = b\ndef f(): pass')) == \
        ["c = b", "def f():"]  # positive control


# Nested (function-level) imports are allowed for these optional or heavy packages only, each for its reason.
LAZY = {
    "vllm": "optional (the cpu/gpu extras); importing it starts CUDA/platform detection and takes seconds",
    "bitsandbytes": "optional (QLoRA only)",
    "wandb": "optional tracker", "trackio": "optional tracker", "tensorboard": "optional tracker",
    "torch.utils.tensorboard": "optional tracker (needs tensorboard)",
    "datasets": "optional: only `hf:` data names and save_to_disk folders need it",
    "pyarrow": "optional: only parquet data needs it",
    "httpx": "optional: only the vLLM server backend needs it",
    "trl": "a benchmark dependency, never a runtime one",
    "IPython": "only in a notebook", "playwright": "only the notebook screenshots",
}
# Modules loaded by file path in processes that must not import minirl or torch: stdlib (and relative) imports only.
STANDALONE = ("minirl/rewards/sandbox", "minirl/rewards/worker_main.py", "minirl/core/lifecycle.py",
              "minirl/core/watchdog_main.py")


def nested_imports(tree: ast.Module) -> list[str]:
    """Imports below the module's top level (outside `if TYPE_CHECKING:`) of anything not in LAZY."""
    typing_only = {id(x) for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                   for x in ast.walk(n)}
    top = {id(n) for n in tree.body}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top and id(n) not in typing_only:
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
            if not all(any(m == k or m.startswith(k + ".") for k in LAZY) for m in names):
                out.append(f"{n.lineno}: {ast.unparse(n)}")
    return out


def test_imports_are_at_the_top_of_each_module():
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py")
             if not str(p.relative_to(ROOT)).startswith(STANDALONE) if (got := nested_imports(ast.parse(p.read_text())))}
    assert not found, f"move these to the module's head (or name the package in LAZY, with its reason): {found}"
    assert nested_imports(ast.parse("def f():\n    import vllm\n    from minirl import x\n")) == \
        ["3: from minirl import x"]  # positive control


def foreign_imports(tree: ast.Module, siblings: frozenset = frozenset()) -> list[str]:
    """Imports of neither the standard library nor `siblings` (modules of the same folder, which a script run
    from that folder imports by their bare name)."""
    ok = sys.stdlib_module_names | {"__future__"} | siblings
    return [ast.unparse(n) for n in ast.walk(tree)
            if (isinstance(n, ast.Import) and any(a.name.split(".")[0] not in ok for a in n.names))
            or (isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] not in ok)]


def test_standalone_modules_import_only_the_standard_library():
    """The sandbox (run by a system Python), the reward workers' and the watchdog's programs start without minirl's
    dependencies: relative and standard-library imports only."""
    paths = [p for s in STANDALONE for p in ((ROOT / s).rglob("*.py") if (ROOT / s).is_dir() else [ROOT / s])]
    assert len(paths) >= 7
    found = {str(p.relative_to(ROOT)): got for p in paths
             if (got := foreign_imports(ast.parse(p.read_text()), frozenset(q.stem for q in p.parent.glob("*.py"))))}
    assert not found, found
    assert foreign_imports(ast.parse("import os\nfrom . import x\nimport torch\nfrom minirl.core import y\n"
                                     "from confine import z\nfrom other import w"), frozenset({"confine"})) == \
        ["import torch", "from minirl.core import y", "from other import w"]  # positive control


# ---- issue 50 item 6: other packages' internals are touched in one module, read off what the code touches --------

COMPAT = "minirl/sync/vllm_compat.py"
# Private names of other packages reached outside COMPAT, each for its reason: `expression` (anywhere) or
# `path:expression` (in that module only).
PRIVATE_ALLOWED = {
    "os._exit": "the standard library's documented exit without cleanup, for a child process",
    "minirl/config/cli.py:argparse._ArgumentGroup": "an annotation, never evaluated (argparse names no public type)",
    "minirl/core/adapter.py:torch._foreach_copy_": "the trainer's pack: core sits below sync in the layers (the name "
                                                  "is checked on the installed torch by tests/test_vllm_compat.py)",
    "minirl/training/trainer.py:self.model.get_base_model().config._attn_implementation":
        "transformers has no public getter (its docs read this); training sits below sync in the layers",
}
ATTR_CALLS = ("getattr", "hasattr", "setattr", "delattr")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))  # dunders: Python's protocol


def own_privates(tree: ast.AST) -> set[str]:
    """The private names a module defines itself: its functions and classes, class attributes, `self._x = ...`."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
            out |= {t.id for b in n.body if isinstance(n, ast.ClassDef) and isinstance(b, (ast.Assign, ast.AnnAssign))
                    for t in (b.targets if isinstance(b, ast.Assign) else [b.target]) if isinstance(t, ast.Name)}
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) in ("self", "cls"):
            out.add(n.attr)
    return {x for x in out if is_private(x)}


def private_accesses(tree: ast.AST) -> list[str]:
    """`x._name` and getattr / hasattr / setattr / delattr(x, "_name") where x is not `self` or `cls` (a module
    counts: `torch._foreach_copy_`) and `_name` is not one the module defines itself, and imports of a private
    module or name of another package than minirl: a private name of another package (vLLM, torch, transformers,
    the standard library), whatever the name."""
    own, out = own_privates(tree), []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                [] if n.level else [f"{n.module}.{a.name}" for a in n.names]
            out += [x for x in names if x.split(".")[0] != "minirl" and any(map(is_private, x.split(".")))]
            continue
        if isinstance(n, ast.Attribute) and is_private(n.attr):
            obj, name, expr = n.value, n.attr, ast.unparse(n)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ATTR_CALLS and \
                len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and is_private(str(n.args[1].value)):
            obj, name, expr = n.args[0], n.args[1].value, ast.unparse(n)
        else:
            continue
        if ast.unparse(obj) not in ("self", "cls") and name not in own:
            out.append(expr)
    return sorted(out)


def test_private_names_of_other_packages_only_in_the_compatibility_module():
    """Outside minirl/sync/vllm_compat.py no module reaches a private name of another package (`private_accesses`:
    found by what is touched, an underscore name on anything but `self` / `cls` that the module does not define
    itself, not by a list of names), except the few in PRIVATE_ALLOWED, each with its reason and each still used."""
    found, used = {}, set()
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        for e in private_accesses(ast.parse(p.read_text())) if rel != COMPAT else ():
            keys = {e, f"{rel}:{e}"} & set(PRIVATE_ALLOWED)
            used |= keys
            if not keys:
                found.setdefault(rel, []).append(e)
    assert not found, f"private names of other packages outside {COMPAT} (give it a hook there): {found}"
    assert used == set(PRIVATE_ALLOWED), f"exceptions no longer needed: {set(PRIVATE_ALLOWED) - used}"
    planted = ("import torch, torch._dynamo\nfrom vllm.lora import _x\nfrom minirl.a import _b\nfrom ._c import d\n"
               "class P:\n    _kept = 1\n    def __init__(self):\n        self._own = 0\n"
               "def f(self, wm, p):\n    wm._adapter_manager; torch._foreach_copy_([], []); self._x\n"
               "    getattr(wm, '_load_adapter', None); p._own; p._kept; p.__dict__; p._f\ndef _f(): pass\n")
    assert private_accesses(ast.parse(planted)) == ["getattr(wm, '_load_adapter', None)", "torch._dynamo",
                                                    "torch._foreach_copy_", "vllm.lora._x", "wm._adapter_manager"]
    assert private_accesses(ast.parse((ROOT / COMPAT).read_text()))  # and it sees the compatibility module's


def worker_modules() -> list[str]:
    """What runs inside vLLM's worker: the receiver (the worker extension) and the sync modules it imports, directly
    or through others (the core helpers it imports are the trainer's too, and take no vLLM object)."""
    start = "minirl.sync.receiver"
    return sorted(m for m in {start} | set(reach(start, imports(modules()))) if within(m, "minirl.sync"))


def scope_nodes(scope: ast.AST):
    """The nodes of a module or function, not those of the functions and classes inside it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(n))


def foreign_stores(tree: ast.AST) -> list[str]:
    """Attribute stores (`x.y = ...`, `x.y += ...`, `del x.y`, setattr / delattr(x, ...)) on anything but `self`,
    `cls` or an object the same function made (`x = SomeClass(...)`): a method or field replaced on an object
    another package owns (monkeypatching)."""
    out = []
    for scope in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        nodes = list(scope_nodes(scope))
        made = {t.id for n in nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
                and ast.unparse(n.value.func).split(".")[-1][:1].isupper() for t in n.targets if isinstance(t, ast.Name)}
        for n in nodes:
            targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else \
                [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                if isinstance(t, ast.Attribute) and ast.unparse(t.value) not in ("self", "cls", *made):
                    out.append(ast.unparse(t))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("setattr", "delattr") \
                    and n.args and ast.unparse(n.args[0]) not in ("self", "cls", *made):
                out.append(ast.unparse(n))
    return sorted(out)


def test_the_worker_modules_replace_nothing_on_vllms_objects():
    """In the modules that run inside vLLM's worker, every method or field replaced on an object of vLLM's (the
    worker, its LoRA manager, the model runner, the LoRA ops' modules) goes through minirl/sync/vllm_compat.py."""
    mods = worker_modules()
    assert {"minirl.sync.receiver", "minirl.sync.slots", "minirl.sync.cpu_lora", "minirl.sync.vllm_compat"} <= set(mods)
    found = {m: got for m in mods if m != "minirl.sync.vllm_compat"
             if (got := foreign_stores(ast.parse(modules()[m].read_text())))}
    assert not found, f"give these a hook in {COMPAT}: {found}"
    planted = ("def f(self, wm, w):\n    wm.add_adapter = g\n    setattr(w, 'execute_model', g)\n    self.ok = 1\n"
               "    ch = Channel()\n    ch.bell = 1\n    w.n += 1\n    del w.m\n    def h():\n        ch.x = 1\n")
    assert foreign_stores(ast.parse(planted)) == \
        ["ch.x", "setattr(w, 'execute_model', g)", "w.m", "w.n", "wm.add_adapter"]  # positive control
    assert foreign_stores(ast.parse((ROOT / COMPAT).read_text()))  # and it sees the compatibility module's


def test_no_module_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


# ---- the boundaries: typed, no probing, and each protocol lists every member its callers use ---------------------

BOUNDARY_ARGS = {"generator", "gen", "trainer", "tr", "cfg", "config", "rollouts"}


def untyped_boundaries(tree: ast.AST) -> list[str]:
    """Parameters named as a boundary object (a generator, the trainer, the config) without an annotation."""
    return [f"{n.name}({a.arg})" for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            for a in n.args.args + n.args.kwonlyargs if a.arg in BOUNDARY_ARGS and a.annotation is None]


def generator_probes(tree: ast.AST) -> list[str]:
    """hasattr / getattr on something named as a generator (or what samples a run's groups)."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("hasattr", "getattr") and n.args:
            target = ast.unparse(n.args[0])
            if re.search(r"\b(gen|generator|rollouts)\b", target):
                out.append(ast.unparse(n))
    return out


def member_uses(tree: ast.AST, names: set[str]) -> set[str]:
    """X in `name.X` and `self.name.X` for `name` in `names`."""
    def named(v: ast.AST) -> bool:
        return (isinstance(v, ast.Name) and v.id in names) or \
            (isinstance(v, ast.Attribute) and isinstance(v.value, ast.Name) and v.value.id == "self"
             and v.attr in names)
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and named(n.value)}


def protocol_members(*protocols) -> set[str]:
    out = set()
    for proto in protocols:
        for cls in proto.__mro__:
            if cls.__module__ not in ("typing", "builtins"):
                out |= {k for k in {**cls.__dict__, **cls.__dict__.get("__annotations__", {})} if not k.startswith("_")}
    return out


def test_boundary_objects_are_typed_everywhere():
    """Every parameter that takes a generator, the trainer or the config says which protocol (or class) it is
    (the config package's own helpers, which take the Config being built, aside: typing them would import
    `fields.py` back into the modules it imports, a circle)."""
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py") if "config" not in p.parts
             if (got := untyped_boundaries(ast.parse(p.read_text())))}
    assert not found, found
    assert untyped_boundaries(ast.parse("def f(trainer, cfg: int): ...")) == ["f(trainer)"]  # positive control


def run_probes(tree: ast.AST) -> list[str]:
    """hasattr / getattr on something named as a run (the dashboard's, the log readers')."""
    return [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("hasattr", "getattr") and n.args and re.search(r"\brun\b", ast.unparse(n.args[0]))]


def test_nothing_probes_a_run():
    """Issue 50 item 7: the dashboard and the log readers take a `RunView` (a live Run, a SavedRun) and ask it
    nothing it does not declare."""
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py") if (got := run_probes(ast.parse(p.read_text())))}
    assert not found, found
    assert run_probes(ast.parse("getattr(self.run, 'cfg', None); hasattr(x, 'y')")) == \
        ["getattr(self.run, 'cfg', None)"]  # positive control


def test_a_live_run_and_a_saved_one_are_both_run_views(tmp_path):
    from minirl import Run
    from minirl.types import RunView
    from minirl.ui import SavedRun
    (tmp_path / "metrics.jsonl").write_text('{"event": "step", "step": 0}\n')
    for view in (Run(out_dir=str(tmp_path / "r")), SavedRun(tmp_path), SavedRun([{"step": 0}])):
        assert isinstance(view, RunView), view
        assert set(protocol_members(RunView)) <= set(dir(view))


def test_nothing_probes_a_generator():
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py")
             if (got := generator_probes(ast.parse(p.read_text())))}
    assert not found, found
    assert generator_probes(ast.parse("hasattr(self.generator, 'engine'); getattr(x, 'y')")) == \
        ["hasattr(self.generator, 'engine')"]  # positive control


def test_each_protocol_lists_every_member_its_callers_use():
    """What each caller uses of the trainer, of a generator and of the episode runner's generator, read off the
    code, is declared by the protocol it is typed with."""
    from minirl.sync.base import AdapterTarget
    from minirl.sync.servers import ServerTarget
    from minirl.sync.tensor import InMemoryTarget
    from minirl.types import (
        AdapterSource,
        AsyncGenerator,
        Checkpointable,
        PolicyTrainer,
        RolloutSource,
        RunView,
        Scorable,
        Sleeper,
        TurnSampler,
    )

    def uses(paths, names, cls=None):  # cls: only inside that class (a module may use the same name for another thing)
        trees = [ast.parse((PKG / p).read_text()) for p in paths]
        if cls is not None:
            trees = [n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef) and n.name == cls]
        return set().union(*(member_uses(t, names) for t in trees))
    sync_files = [str(p.relative_to(PKG)) for p in (PKG / "sync").glob("*.py") if p.name != "check.py"]  # its own row
    checks = {  # (callers, the names they hold it under) -> the protocols that declare it
        "trainer in sync/": (uses(sync_files, {"trainer"}), protocol_members(AdapterSource)),
        "trainer in make_generator, SyncCheck": (uses(["generation/factory.py", "sync/check.py"], {"trainer"}),
                                                 protocol_members(PolicyTrainer)),
        "trainer in checkpoints": (uses(["run/checkpoint.py", "run/folder.py"], {"trainer"}),
                                   protocol_members(Checkpointable)),
        "generator in sync/": (uses(sync_files, {"generator", "_gen"}),  # sync.verify checks a Scorable
                               protocol_members(AdapterTarget, InMemoryTarget, ServerTarget, Scorable)),
        "generator in the run": (uses(["run/loop.py", "run/build.py", "sync/check.py", "run/evaluation.py"],
                                      {"generator", "gen", "rollouts", "sleeper"})
                                 | uses(["pipeline/rollout.py"], {"gen", "generator"}, cls="Pipeline"),
                                 protocol_members(AsyncGenerator, Sleeper)),
        "generator in episodes": (uses(["generation/episodes.py"], {"gen", "generator"}),
                                  protocol_members(RolloutSource, TurnSampler)),
        "run in the dashboard": (uses(["ui/dashboard.py"], {"run"}), protocol_members(RunView)),
    }
    undeclared = {k: sorted(used - declared) for k, (used, declared) in checks.items() if used - declared}
    assert not undeclared, undeclared
    assert all(used for used, _ in checks.values())  # positive control: the uses are read at all
    assert member_uses(ast.parse("trainer.opt.step(); self.trainer.version"), {"trainer"}) == {"opt", "version"}


# ---- issue 50 items 4-5: the config writes nothing into itself; advantages are made in one function -----------

ADVANTAGE_CALLERS = {"minirl/run/loop.py": "each step's batch, before training",
                     "minirl/ui/prototype.py": "the reward lab's preview of what a run would train on",
                     "minirl/ui/episodes.py": "the episode preview's scores"}


def calls_to(tree: ast.AST, name: str) -> int:
    return sum(isinstance(n, ast.Call) and name in (getattr(n.func, "id", None), getattr(n.func, "attr", None))
               for n in ast.walk(tree))


def advantage_makers(tree: ast.AST) -> list[str]:
    """What in a module makes advantages: a call to the advantage math, or `advantages=` given to a copy."""
    out = [f"calls {f}" for f in ("group_advantages", "rloo_advantages", "batch_scale") if calls_to(tree, f)]
    out += ["sets advantages= on a copy" for n in ast.walk(tree) if isinstance(n, ast.Call)
            and getattr(n.func, "id", getattr(n.func, "attr", None)) == "replace"
            and any(k.arg == "advantages" for k in n.keywords)]
    return out


def test_advantages_are_made_in_one_function_called_from_one_place():
    makers, callers = {}, set()
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text())
        if rel != "minirl/rewards/advantages.py" and advantage_makers(tree):
            makers[rel] = advantage_makers(tree)
        if calls_to(tree, "step_advantages"):
            callers.add(rel)
    assert makers == {}, f"advantages made outside rewards/advantages.py: {makers}"
    assert callers == set(ADVANTAGE_CALLERS), callers
    planted = ast.parse("import dataclasses\ng = dataclasses.replace(g, advantages=(1.0,))\nx = batch_scale([])")
    assert advantage_makers(planted) == ["calls batch_scale", "sets advantages= on a copy"]  # the check sees them


def test_the_config_never_writes_into_its_frozen_instance():
    hits = [f"{p.name}:{i}" for p in (PKG / "config").glob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "object.__setattr__" in line]
    assert hits == []
