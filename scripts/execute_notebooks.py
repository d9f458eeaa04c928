"""Executed copies of the notebooks, at full settings: each notebook runs top to bottom as a reader runs it (the
embedded model, `BACKEND = "auto"`, no CI switch set) in a fresh temporary folder, and its copy with outputs is
written to docs/notebooks/<name>.ipynb, every image output (the matplotlib plots) also to
docs/notebooks/<name>/cell<NN>-<k>.png, and docs/notebooks/README.md lists them.

    nice -n 10 .venv/bin/python scripts/execute_notebooks.py                  # all four, one at a time
    nice -n 10 .venv/bin/python scripts/execute_notebooks.py quickstart       # one of them
    .venv/bin/python scripts/execute_notebooks.py --text-only                  # markdown edits only, no run

tests/test_notebooks.py checks that the copies' code cells are the notebooks' own: after editing a notebook, run
this again for it. A notebook that fails leaves its old copy in place and the exit status is 1. Each notebook's
wall time is printed (and kept in the copy's metadata, `minirl_executed`)."""
from __future__ import annotations

import argparse
import base64
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "notebooks"
OUT = ROOT / "docs" / "notebooks"
SWITCHES = ("MINIRL_NB_SMALL", "MINIRL_NB_BACKEND")  # the CI switches: unset, so the notebook runs as a reader's


def image_name(cell_index: int, k: int) -> str:
    """The file of the k-th image output (from 1) of the notebook's cell `cell_index` (from 0, all cells counted)."""
    return f"cell{cell_index:02d}-{k}.png"


def images(nb) -> list[tuple[str, bytes]]:
    """(file name, PNG bytes) of every image/png output, in order."""
    found = []
    for i, cell in enumerate(nb.cells):
        pngs = [o["data"]["image/png"] for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        found += [(image_name(i, k), base64.b64decode(p)) for k, p in enumerate(pngs, 1)]
    return found


def commit() -> str:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "notebooks", "minirl"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return rev + ("+edits" if dirty else "")


def machine() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    except ImportError:
        pass
    model = platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU, {os.cpu_count()} cores ({model})"


def scrub(nb, work: Path) -> None:
    """The temporary folder's path out of the outputs: the copy shows the relative paths a reader sees."""
    for cell in nb.cells:
        for o in cell.get("outputs", []):
            if "text" in o:
                o["text"] = o["text"].replace(str(work) + "/", "").replace(str(work), ".")
            for mime in ("text/plain", "text/html"):
                if isinstance(o.get("data", {}).get(mime), str):
                    o["data"][mime] = o["data"][mime].replace(str(work) + "/", "").replace(str(work), ".")


def execute(name: str, timeout: int) -> float:
    import nbclient
    import nbformat

    nb = nbformat.read(SOURCES / f"{name}.ipynb", as_version=4)
    work = Path(tempfile.mkdtemp(prefix=f"minirl-nb-{name}-"))
    for var in SWITCHES:
        os.environ.pop(var, None)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    t0 = time.time()
    try:
        nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(work)}}).execute()
    finally:
        took = time.time() - t0
        shutil.rmtree(work, ignore_errors=True)
    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    if errors:
        raise RuntimeError(f"{name}: {errors[0].get('ename')}: {errors[0].get('evalue')}")
    scrub(nb, work)
    nb.metadata["minirl_executed"] = {"commit": commit(), "machine": machine(), "seconds": round(took),
                                      "command": f"python scripts/execute_notebooks.py {name}"}
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for file, data in images(nb):
        (folder / file).write_bytes(data)
    nbformat.write(nb, OUT / f"{name}.ipynb")
    return took


def refresh_text(name: str) -> None:
    """The copy's markdown cells from the notebook, without running it: only for a copy whose code is the notebook's."""
    import nbformat

    source, path = nbformat.read(SOURCES / f"{name}.ipynb", as_version=4), OUT / f"{name}.ipynb"
    copy = nbformat.read(path, as_version=4)
    kinds = lambda nb: [(c.cell_type, c.source if c.cell_type == "code" else "") for c in nb.cells]  # noqa: E731
    if kinds(source) != kinds(copy):
        raise RuntimeError(f"{name}: its code or cells changed since the copy was made: run it again")
    for mine, theirs in zip(copy.cells, source.cells):
        if mine.cell_type == "markdown":
            mine.source = theirs.source
    nbformat.write(copy, path)


def write_index() -> None:
    import nbformat

    lines = ["# Executed notebooks", "",
             "The notebooks of [notebooks/](../../notebooks), run top to bottom at full settings on the embedded model",
             "(`BACKEND = \"auto\"`), with their outputs, and their plots as image files. Written by",
             "[`scripts/execute_notebooks.py`](../../scripts/execute_notebooks.py); how long each took is in",
             "[BENCHMARKS.md](../../BENCHMARKS.md#executed-notebooks).", "",
             "| notebook | executed copy | plots | executed at | on |", "| --- | --- | --- | --- | --- |"]
    for path in sorted(OUT.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        meta = nb.metadata.get("minirl_executed", {})
        pngs = ", ".join(f"[{f}]({path.stem}/{f})" for f, _ in images(nb)) or "none"
        lines.append(f"| [{path.stem}](../../notebooks/{path.name}) | [{path.name}]({path.name}) | {pngs} | "
                     f"{meta.get('commit', '?')} | {meta.get('machine', '?')} |")
    for path in sorted(SOURCES.glob("*.ipynb")):
        if not (OUT / path.name).exists():
            lines.append(f"| [{path.stem}](../../notebooks/{path.name}) | not executed yet | | | |")
    (OUT / "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="notebooks to run (default: all of notebooks/*.ipynb)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds one cell may take")
    ap.add_argument("--text-only", action="store_true",
                    help="copy the notebooks' markdown cells into the copies, without running (code unchanged)")
    a = ap.parse_args()
    names = a.names or sorted(p.stem for p in SOURCES.glob("*.ipynb"))
    unknown = [n for n in names if not (SOURCES / f"{n}.ipynb").exists()]
    if unknown:
        print(f"no notebook {unknown}: choose from {sorted(p.stem for p in SOURCES.glob('*.ipynb'))}", file=sys.stderr)
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    failed = False
    if a.text_only:
        for name in names:
            refresh_text(name)
        write_index()
        return 0
    for name in names:  # one at a time: each is a training run that takes the machine's cores
        print(f"{name}: running", flush=True)
        try:
            took = execute(name, a.timeout)
            print(f"{name}: {took:.0f} s -> {(OUT / name).relative_to(ROOT)}.ipynb", flush=True)
        except Exception as e:  # noqa: BLE001 - reported; the other notebooks still run
            print(f"{name}: FAILED ({e}); its previous copy is kept", flush=True)
            failed = True
    write_index()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
