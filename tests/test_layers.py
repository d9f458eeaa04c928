"""The import graph of minirl/ against the layers declared in docs/architecture.md: nothing imports upward or
sideways, and no package's submodules import each other in a circle. Function-level imports count too."""
import ast
import re
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


def test_no_package_imports_itself_in_a_circle():
    """Within a package its submodules form no circle (its __init__, the package's front door, may re-export
    them)."""
    mods, edges = modules(), imports(modules())
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    found = []
    for pkg in packages:
        inner = {m for m in mods if m.rpartition(".")[0] == pkg and m not in packages}
        found += cycles(inner, edges)
    assert not found, f"import circles: {found}"


def test_the_checks_see_a_fault():
    """Positive controls: an upward import and a circle planted in a copy of the graph are caught."""
    layers = declared_layers()
    assert layers["run"] > layers["types"]
    assert cycles({"a", "b", "c"}, {"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a", "b"}, {"a": {"b"}}) == []
    edges = imports(modules())
    assert any(component(t) == "types" for t in edges["minirl.run.loop"])  # the graph is read at all
    assert against_layers({"minirl.types": {"minirl.run.loop"}}, layers) == ["minirl.types -> minirl.run.loop"]
    assert against_layers({"minirl.sync": {"minirl.training.trainer"}}, layers) == ["minirl.sync -> minirl.training.trainer"]


PRIVATE_HOOKS = {"_load_adapter", "_adapter_manager", "_update_states", "lora_ops", "_Options", "_timeout",
                 "_devices", "_share_cuda_", "_new_shared_cuda", "_get_lora_layer_weights", "punica_cpu"}


def private_accesses(tree: ast.AST) -> list[str]:
    return [n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in PRIVATE_HOOKS]


def test_private_vllm_and_torch_hooks_only_in_the_compatibility_module():
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py") if p.name != "vllm_compat.py"
             if (got := private_accesses(ast.parse(p.read_text())))}
    assert not found, f"private hooks outside minirl/vllm_compat.py: {found}"
    assert private_accesses(ast.parse((PKG / "vllm_compat.py").read_text()))  # positive control: it sees them


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


def test_nothing_probes_a_generator():
    found = {str(p.relative_to(ROOT)): got for p in PKG.rglob("*.py")
             if (got := generator_probes(ast.parse(p.read_text())))}
    assert not found, found
    assert generator_probes(ast.parse("hasattr(self.generator, 'engine'); getattr(x, 'y')")) == \
        ["hasattr(self.generator, 'engine')"]  # positive control


def test_sync_imports_nothing_of_generators():
    edges = imports(modules())
    bad = {m: sorted(t for t in ts if component(t) == "generators") for m, ts in edges.items()
           if component(m) == "sync" and any(component(t) == "generators" for t in ts)}
    assert not bad, bad
    assert any(component(t) == "sync" for t in edges["minirl.generation"])  # positive control: the graph sees edges


def test_each_protocol_lists_every_member_its_callers_use():
    """What each caller uses of the trainer, of a generator and of the episode runner's generator, read off the
    code, is declared by the protocol it is typed with."""
    from minirl.sync.base import AdapterTarget
    from minirl.sync.servers import ServerTarget
    from minirl.sync.tensor import InMemoryTarget
    from minirl.types import (AdapterSource, AsyncGenerator, Checkpointable, PolicyTrainer, RolloutSource, Scorable,
        Sleeper, TurnSampler)

    def uses(paths, names, cls=None):  # cls: only inside that class (a module may use the same name for another thing)
        trees = [ast.parse((PKG / p).read_text()) for p in paths]
        if cls is not None:
            trees = [n for t in trees for n in ast.walk(t) if isinstance(n, ast.ClassDef) and n.name == cls]
        return set().union(*(member_uses(t, names) for t in trees))
    sync_files = [str(p.relative_to(PKG)) for p in (PKG / "sync").glob("*.py")]
    checks = {  # (callers, the names they hold it under) -> the protocols that declare it
        "trainer in sync/": (uses(sync_files, {"trainer"}), protocol_members(AdapterSource)),
        "trainer in make_generator, SyncCheck": (uses(["generators/__init__.py", "sync_check.py"], {"trainer"}),
                                                 protocol_members(PolicyTrainer)),
        "trainer in checkpoints": (uses(["checkpoint.py", "run_dir.py"], {"trainer"}),
                                   protocol_members(Checkpointable)),
        "generator in sync/": (uses(sync_files, {"generator", "_gen"}),  # sync.verify checks a Scorable
                               protocol_members(AdapterTarget, InMemoryTarget, ServerTarget, Scorable)),
        "generator in the run": (uses(["run.py", "parts.py", "sync_check.py", "evaluation.py"],
                                      {"generator", "gen", "rollouts", "sleeper"})
                                 | uses(["rollout.py"], {"gen", "generator"}, cls="Pipeline"),
                                 protocol_members(AsyncGenerator, Sleeper)),
        "generator in episodes": (uses(["episodes.py"], {"gen", "generator"}),
                                  protocol_members(RolloutSource, TurnSampler)),
    }
    undeclared = {k: sorted(used - declared) for k, (used, declared) in checks.items() if used - declared}
    assert not undeclared, undeclared
    assert all(used for used, _ in checks.values())  # positive control: the uses are read at all
    assert member_uses(ast.parse("trainer.opt.step(); self.trainer.version"), {"trainer"}) == {"opt", "version"}
