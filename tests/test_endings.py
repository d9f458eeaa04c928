"""No process outlives its run, however the run ends (issue 23): after a normal end, an exception, SIGINT and SIGTERM
(during set-up; SIGTERM mid-run too) and a SIGKILL of the trainer (what a notebook kernel's death looks like), no
process the run started is left within 10 s and no shared-memory file of it either. For the transformers generator
process (the K >= 1 CPU pipeline, on the tiny model) and the in-process vLLM engine (its SIGKILL: the case that left
an orphaned engine core holding its memory).

What "of the run" means is gathered while it runs: every process below the trainer (the generator process, the
engine core, Python's resource tracker, minirl's watchdog) with its start time, and every shared-memory file that
one of them maps or holds open, or that is named after the trainer's pid.
"""
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from conftest import TOY_ROWS
from test_cli import _write_run

from minirl import Run
from minirl.run.checkpoint import latest_checkpoint
from minirl.sync.files import tmpfs_dir

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only (/proc, PDEATHSIG)")

SHM = tmpfs_dir()
WAIT_S = 300  # a generous bound on waits that normally take seconds (a loaded 2-core machine)


class Watch:
    """The processes (pid -> start time) and shared-memory files of the run under process `root` (or, with
    `below_me`, of the run inside this process: the processes started since the watch began)."""

    def __init__(self, root: int, below_me: bool = False):
        self.root, self.below_me = root, below_me
        self.before = {p.pid for p in psutil.Process(root).children(recursive=True)} if below_me else set()
        self.procs: dict[int, float] = {}
        self.cmds: dict[int, str] = {}  # pid -> command line, as seen while it ran
        self.files: set[str] = set()
        self.old_files = set(self._named_after_root())  # an earlier test's in this process: not this run's

    def _named_after_root(self) -> list[str]:
        # the run's own: '-<root pid>' as a whole field (a substring test took pid 15813's folders for pid 1581's)
        return [str(SHM / n) for n in os.listdir(SHM)
                if n.startswith("minirl-") and re.search(rf"-{self.root}(-|$)", n)]

    def sample(self) -> None:
        try:
            me = psutil.Process(self.root)
            procs = me.children(recursive=True) + ([] if self.below_me else [me])
        except psutil.NoSuchProcess:
            return
        for p in procs:
            if p.pid in self.before:
                continue
            try:
                self.procs[p.pid] = p.create_time()
                self.cmds[p.pid] = " ".join(p.cmdline())
                held = [m.path for m in p.memory_maps()] + [f.path for f in p.open_files()]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            self.files.update(f for f in held if f.startswith(str(SHM) + "/"))
        self.files.update(set(self._named_after_root()) - self.old_files)

    def left(self, but: tuple[int, ...] = ()) -> list:
        alive = []
        for pid, t in self.procs.items():
            try:
                p = psutil.Process(pid)
                if pid not in but and p.create_time() == t and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:120]}")
            except psutil.NoSuchProcess:
                pass
        return alive + [f for f in self.files if os.path.exists(f)]

    def assert_all_gone(self, within_s: float = 10.0, but: tuple[int, ...] = ()) -> float:
        t0 = time.monotonic()
        while (left := self.left(but)) and time.monotonic() - t0 < within_s:
            time.sleep(0.1)
        assert not left, f"left behind {within_s} s after the run ended: {left}"
        return time.monotonic() - t0


class _Lines(list):
    """The lines of a stream, read by a thread as they come; `finish()` once the process ended waits for the
    last ones (the thread ends at the stream's end)."""

    def __init__(self, stream):
        super().__init__()
        self._reader = threading.Thread(target=lambda: self.extend(stream), daemon=True)
        self._reader.start()

    def finish(self) -> "_Lines":
        self._reader.join(WAIT_S)
        assert not self._reader.is_alive(), "the stream never ended"
        return self


def _lines(stream) -> _Lines:
    return _Lines(stream)


def _until(child: subprocess.Popen, watch: Watch, ready, lines: list[str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        assert child.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "the run never got there"
        watch.sample()
        time.sleep(0.1)
    watch.sample()


GENPROC = "minirl.generation.hf_process import _serve"  # in the generator process's command line


def _genproc_loading(watch: Watch) -> bool:
    """The generator process is starting (loading its model) and its shared-memory file exists."""
    return any(SHM.glob(f"minirl-genproc-{watch.root}-*")) and any(
        GENPROC in c and psutil.pid_exists(p) for p, c in watch.cmds.items())


# --- the transformers generator process ----------------------------------------------------------------------

@pytest.mark.parametrize("ending", ["normal", "exception"])
def test_a_run_that_ends_or_raises_ends_its_generator_process(toy_cfg, ending):
    """In-process (a notebook's kernel lives on after the run): the run's own end must end its children."""
    watch = Watch(os.getpid(), below_me=True)
    run = Run(toy_cfg.replace(max_async_steps=1, steps=3), data=TOY_ROWS)
    run.on_step.append(lambda rec: watch.sample())
    if ending == "exception":
        run.on_step.append(lambda rec: rec["step"] == 1 and 1 / 0)
    if ending == "normal":
        assert run.run()["steps"] == 3
    else:
        with pytest.raises(ZeroDivisionError):
            run.run()
    from minirl.core import lifecycle
    assert any(GENPROC in c for c in watch.cmds.values()), f"no generator process seen: {watch.cmds}"
    # the watchdog and Python's resource tracker belong to this (pytest) process, not to the run: they stay
    keep = tuple(p for p, c in watch.cmds.items() if p == lifecycle.watchdog_pid() or "resource_tracker" in c)
    took = watch.assert_all_gone(but=keep)
    print(f"{ending}: all gone {took:.1f} s after the run returned")


def test_sigterm_stops_the_cli_cleanly(tiny_model, tmp_path):
    """Mid-run: the step ends or is abandoned, a checkpoint is written, the children are closed, the exit code is
    143, and one line names the command that continues. (Ctrl-C takes the same path: its mid-run line is checked
    in test_resume.py, its set-up ending below.)"""
    sig = "SIGTERM"
    _write_run(tmp_path, tiny_model, max_async_steps=1)
    child = subprocess.Popen([sys.executable, "-m", "minirl.cli", "train", "my.yaml", "--steps", "500",
                              "--checkpoint-every", "1"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    watch, lines = Watch(child.pid), _lines(child.stderr)
    _until(child, watch, lambda: any(x.startswith("step 2/500") for x in lines), lines)
    child.send_signal(getattr(signal, sig))
    assert child.wait(WAIT_S) == 128 + getattr(signal, sig), "".join(lines)[-3000:]
    took = watch.assert_all_gone()
    lines.finish()
    last, done = lines[-1].strip(), latest_checkpoint(tmp_path / "runs/my").step
    assert done >= 2 and last.startswith("minirl: interrupted after") and "(SIGTERM)" in last
    assert last.endswith("`minirl train my.yaml --steps 500 --checkpoint-every 1 --resume` continues after step "
                         f"{done} (the latest checkpoint)")
    assert not any("Traceback" in x for x in lines)
    print(f"{sig}: all gone {took:.1f} s after the exit")


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_kill_during_set_up_leaves_nothing(tiny_model, tmp_path, sig):
    """While the generator process loads its model (its shared-memory file not yet unlinked): Ctrl-C and SIGTERM
    stop the set-up cleanly (exit 130 / 143, one line, nothing written); SIGKILL (a notebook kernel killed) leaves
    the watchdog and PR_SET_PDEATHSIG to end the generator process and remove the file."""
    _write_run(tmp_path, tiny_model, max_async_steps=1)
    child = subprocess.Popen([sys.executable, "-m", "minirl.cli", "train", "my.yaml"], cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watch, lines = Watch(child.pid), _lines(child.stderr)
    _until(child, watch, lambda: _genproc_loading(watch), lines)
    assert watch.files, "the generator's shared-memory file was never seen"
    child.send_signal(getattr(signal, sig))
    code = child.wait(WAIT_S)
    took = watch.assert_all_gone()
    if sig != "SIGKILL":
        lines.finish()
        why = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM"}[sig]
        assert code == 128 + getattr(signal, sig), "".join(lines)[-3000:]
        assert lines[-1].startswith(f"minirl: stopped during set-up ({why}); nothing was written"), lines[-3:]
        assert not (tmp_path / "runs/my").exists() or not any((tmp_path / "runs/my").iterdir())
    else:
        assert code == -signal.SIGKILL
    print(f"{sig} during set-up: all gone {took:.1f} s after the exit")


# --- the vLLM engine -----------------------------------------------------------------------------------------

ENGINE = """
import sys
from minirl.generation.vllm import VLLMGenerator
from minirl.types import Prompt, SamplingParams
if __name__ == "__main__":  # the engine core is spawned
    gen = VLLMGenerator(sys.argv[1], max_lora_rank=8, max_model_len=256, kv_cache_gb=0.25)
    gen.generate([Prompt(0, (1, 2, 3), "")], 2, SamplingParams(max_tokens=4, seed=0))
    print("serving", flush=True)
    sys.stdin.read()
"""


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_a_sigkilled_trainer_takes_its_vllm_engine_with_it(embedded_model, tmp_path):
    """The trainer (here a script serving one engine) is SIGKILLed: its engine core and everything below it end
    within 10 s (before the watchdog, it lived on, reparented to init, holding its memory)."""
    (tmp_path / "engine.py").write_text(ENGINE)
    child = subprocess.Popen([sys.executable, str(tmp_path / "engine.py"), embedded_model], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch, lines = Watch(child.pid), _lines(child.stdout)
    _until(child, watch, lambda: "serving\n" in lines, lines)
    assert any("EngineCore" in c or "spawn_main" in c for c in watch.cmds.values()), watch.cmds
    child.kill()
    child.wait(WAIT_S)
    took = watch.assert_all_gone()
    print(f"vLLM, SIGKILL: all gone {took:.1f} s after the kill")
