"""The run folder and its checkpoints: everything needed to continue a run exactly, and nothing written halfway.

    out_dir/config.yaml          the config the run started with
    out_dir/metrics.jsonl        the event log (a resumed run appends a "resume" event; it is never truncated)
    out_dir/adapter/             the latest adapter, peft format
    out_dir/summary.json
    out_dir/checkpoints/step-000012/
        adapter_config.json, adapter_model.safetensors   the adapter after 12 steps
        trainer.pt    optimizer and scheduler state, the torch (CPU and CUDA) and Python RNG states
        state.json    next step, policy version, data position, data fingerprint, the live config

Files are written under a temporary name in their folder, fsynced, and renamed over the target, then the folder
is fsynced; a checkpoint is written to a temporary folder, fsynced (files and folder) and renamed into place. A
rename is atomic, so a kill at any instant leaves the old file or the new one, never a mixture, and a checkpoint
folder either is complete or does not exist; the fsyncs make the same hold after a power loss (no empty
`trainer.pt` under a renamed name). A checkpoint of a step that exists already (a resumed run's re-done step)
replaces it by: rename the old one aside, rename the new one in, delete the old one; a failure in between puts
the old one back, and a crash in between leaves it aside, where the next listing finds it.

What a checkpoint does not hold: rollouts generated ahead of the trainer (K >= 1). They are regenerated on resume,
for the same steps from the same prompts with the same per-step seeds, under the restored policy: the prompts
trained at each step are exactly those of an uninterrupted run, none lost, none twice. Saving them instead would
not make a K >= 1 run exact: what the buffer holds at a given step, and under which versions it was sampled,
depends on timing, so an uninterrupted run is not reproducible token for token either.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from minirl.config import Config, ConfigError
from minirl.core.metrics import read_log, supersede
from minirl.types import Checkpointable

# what a run writes into its out_dir (all of it goes on --overwrite; nothing else there is touched)
RUN_FILES = ("metrics.jsonl", "summary.json", "config.yaml", "adapter", "checkpoints", "reward.png", "dashboard.png",
             "tensorboard")

# fields a resumed run may change: length, cadence, logging and the machine it runs on. Every other field decides
# what is trained; changing it would make the continuation a different run.
RESUME_FREE = frozenset({"steps", "eval_every", "checkpoint_every", "keep_checkpoints", "log_samples", "report_to",
                         "out_dir", "backend", "gen_devices", "train_devices", "gpu_memory_utilization", "kv_cache_gb",
                         "sync_transport", "verify_sync", "reward_timeout_s", "inflight", "max_async_steps"})


# written when a run claims its out_dir: --overwrite deletes run files only in a folder that carries it
MARKER = ".minirl-run"
ASIDE = ".aside-"  # an old checkpoint of the same step, renamed aside while its replacement is renamed in


class RunExists(ConfigError):
    """out_dir already holds a run, and neither resume nor overwrite was asked for."""


# --- atomic writes ------------------------------------------------------------------------------------------

def atomic_write(path: str | Path, write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` writes a temporary file beside `path` (same suffix), which then replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path.parent, path.stem, path.suffix)  # created by `write`: the usual permissions (umask)
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries (the renames in it), to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Every file in `folder`, then the folder itself."""
    for f in folder.iterdir():
        if f.is_file():
            _fsync(f)
    _fsync(folder)


def _temp_name(folder: Path, stem: str, suffix: str = "") -> Path:
    return folder / f".{stem}-{uuid.uuid4().hex[:12]}{suffix}"


def usual_permissions(folder: Path) -> None:
    """Give the files in `folder` the permissions a new file gets (the umask's): safetensors writes its files
    private (0600), which would make an adapter unreadable to the other users of a shared machine."""
    probe = folder / f".probe-{uuid.uuid4().hex[:8]}"
    probe.touch()
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, mode)


def temp_dir(folder: Path, stem: str) -> Path:
    """A new hidden folder in `folder` (mkdtemp's would be private, 0700, and stay so after the rename)."""
    tmp = _temp_name(folder, stem)
    tmp.mkdir()
    return tmp


def atomic_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda p: p.write_text(text))


def save_adapter(trainer: Checkpointable, path: str | Path) -> Path:
    """The trainer's adapter into the folder `path`, each file replaced in one rename (the config first, the
    weights last): a reader sees the old adapter or the new one."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(path.parent, "adapter")
    try:
        trainer.save_adapter(tmp)
        usual_permissions(tmp)
        _fsync_tree(tmp)
        for f in sorted(tmp.iterdir(), key=lambda f: f.suffix == ".safetensors"):
            os.replace(f, path / f.name)
        _fsync(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


# --- the run folder -----------------------------------------------------------------------------------------

def holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in RUN_FILES)


def mark_run(out: Path) -> None:
    """Mark `out` as a minirl run's folder (a run does this when it claims it), which --overwrite requires."""
    atomic_text(out / MARKER, "This folder holds a minirl run; `--overwrite` may delete its run files.\n")


def check_out_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, in one line, to start a new run over an existing one, to overwrite a folder no run claimed (a
    user's own config.yaml there is not a run), or to resume where there is none."""
    if resume and overwrite:
        raise ConfigError("resume and overwrite exclude each other: resume continues the run in out_dir, "
                          "overwrite replaces it")
    _refuse_if_in_use(out)
    if resume and not (out / "metrics.jsonl").exists():
        raise ConfigError(f"nothing to resume in {str(out)!r}: no run there; start one without --resume, or point "
                          "out_dir at the run to continue")
    if overwrite and holds_run(out) and not (out / MARKER).exists():
        found = ", ".join(n for n in RUN_FILES if (out / n).exists())
        raise RunExists(f"{str(out)!r} holds {found} but no minirl run (no {MARKER} marker), so nothing there is "
                        "deleted by --overwrite; move those files out yourself, or choose another out_dir")
    if not resume and not overwrite and holds_run(out):
        raise RunExists(f"{str(out)!r} already holds a run; continue it with --resume (resume=True), replace it "
                        "with --overwrite (overwrite=True), or choose another out_dir")


def _in_use(out: Path, pid: str) -> ConfigError:
    return ConfigError(f"{str(out)!r} is in use by a run that is still going (pid {pid or '?'}); wait for it to end, "
                       "stop it, or choose another out_dir")


def _refuse_if_in_use(out: Path) -> None:
    """Before anything loads (a resume would read checkpoints the going run is rotating away): refuse an out_dir
    whose lock a going run holds. Probes with a shared lock, released at once; writes nothing. `lock_out_dir`
    still takes the lock when the run claims the folder."""
    lock = out / ".lock"
    if lock.is_symlink() or not lock.is_file():
        return  # no run ever held it, or a planted link that lock_out_dir refuses
    with open(lock) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(out, f.read().strip()) from None


def lock_out_dir(out: Path):
    """Hold `out` for this process until the returned file is closed (or the process dies, even by SIGKILL): a
    second run into the same out_dir while one is going, e.g. a --resume started too early, stops in one line."""
    try:  # O_NOFOLLOW: a symbolic link planted as .lock would make this truncate and write the file it points at
        fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{str(out / '.lock')!r} is a symbolic link, not the run's lock file; remove it "
                          "(or choose another out_dir)") from None
    f = os.fdopen(fd, "r+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip()
        f.close()
        raise _in_use(out, pid) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def clear_run(out: Path) -> None:
    """Remove what a run wrote into `out` (for overwrite); other files are left alone. Only in a folder that a
    run marked as its own (`mark_run`)."""
    if holds_run(out) and not (out / MARKER).exists():
        raise RunExists(f"{str(out)!r} carries no {MARKER} marker: not deleting its files")
    for name in RUN_FILES:
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()


def resume_config(given: Config, out: Path, live: dict | None, knobs: Sequence[str]) -> Config:
    """The config a resumed run continues with. `given` may differ from the run's own (out_dir/config.yaml) only in
    RESUME_FREE fields (e.g. more `steps`) and the mid-run knobs; a knob left as the run started keeps the value it
    had at the checkpoint (`live`: a `Run.set` carries over)."""
    original = Config.from_yaml(out / "config.yaml").to_dict() if (out / "config.yaml").exists() else given.to_dict()
    new = given.to_dict()
    changed = [f"{k} ({original[k]!r} -> {new[k]!r})" for k in new
               if k not in RESUME_FREE and k not in knobs and new[k] != original[k]]
    if changed:
        raise ConfigError(f"cannot resume {str(out)!r} with a different {', '.join(changed)}: resume with the run's "
                          "own config (its config.yaml), or start a new run (another out_dir, or --overwrite)")
    for k in knobs:
        if live is not None and new[k] == original[k]:
            new[k] = live[k]
    return Config.from_dict(new)


def resume_point(out: Path, given: Config, knobs: Sequence[str]) -> tuple["Checkpoint | None", Config]:
    """The latest checkpoint in `out` (None: the run stopped before its first; it starts again at step 0) and the
    config to continue with (`resume_config`)."""
    ckpt = latest_checkpoint(out)
    cfg = resume_config(given, out, ckpt.state["config"] if ckpt else None, knobs)
    if ckpt is not None and ckpt.step >= cfg.steps:
        raise ConfigError(f"{str(out)!r} already trained its {ckpt.step} steps; give more steps "
                          f"(e.g. --steps {ckpt.step + 10}) to continue it")
    return ckpt, cfg


def past_steps(out: Path, step: int) -> tuple[list[dict], float | None]:
    """What a run resumed after `step` steps keeps of its log: the step events before `step`, and the held-out
    accuracy measured before training (None if none was)."""
    done = supersede(read_log(out), {"step": step})
    before = next((e["accuracy"] for e in done if e["event"] == "eval" and e["step"] == 0), None)
    return [e for e in done if e["event"] == "step"], before


# --- checkpoints --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int  # steps done: the next step to train
    state: dict  # state.json


def rng_state() -> dict:
    """Every global RNG state sampling or user code may draw from: torch CPU and CUDA, and Python's `random`.
    (Sampling seeds are a function of (seed, step), and the prompt order of (seed, position).)"""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "python": random.getstate()}


def set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    random.setstate(s["python"])


def save_checkpoint(out: Path, trainer: Checkpointable, state: dict, keep: int) -> Path | None:
    """Write checkpoint `state["step"]` (atomically) and delete all but the latest `keep`. A non-finite adapter is
    never written (None is returned): resuming from it could only fail."""
    if not trainer.adapter_is_finite():
        return None
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state['step']:06d}"
    tmp = temp_dir(root, final.name)
    try:
        trainer.save_adapter(tmp)
        torch.save({"trainer": trainer.state_dict(), "rng": rng_state()}, tmp / "trainer.pt")
        (tmp / "state.json").write_text(json.dumps(state, indent=1, default=str))
        usual_permissions(tmp)
        _fsync_tree(tmp)
        _recover_aside(root)
        aside = None
        if final.exists():  # the same step again (a resumed run's re-done step): the newer one wins
            aside = root / f"{ASIDE}{final.name}"
            os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            if aside is not None:
                os.rename(aside, final)
            raise
        _fsync(root)
        if aside is not None:
            shutil.rmtree(aside)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    return final


def _recover_aside(root: Path) -> None:
    """A checkpoint renamed aside by a replace that a crash interrupted: back in place if the new one never
    arrived, else deleted."""
    for aside in root.glob(f"{ASIDE}step-*"):
        final = root / aside.name[len(ASIDE):]
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(aside, final)


def checkpoints(out: Path) -> list[Checkpoint]:
    """The complete checkpoints in `out`, oldest first (temporary folders of an interrupted write are not). A
    state.json that is not JSON, or has no whole-number `step`, is one ConfigError naming the file."""
    root = out / "checkpoints"
    if root.is_dir():
        _recover_aside(root)
    found = []
    for p in sorted(root.glob("step-*")):
        f = p / "state.json"
        if f.exists():
            try:
                state = json.loads(f.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{f}: not valid JSON ({e}); this checkpoint is damaged: delete {str(p)!r} to "
                                  "resume from the one before it") from None
            if not isinstance(state, dict) or not isinstance(state.get("step"), int):
                raise ConfigError(f"{f}: no whole-number 'step'; this checkpoint is damaged: delete {str(p)!r} to "
                                  "resume from the one before it")
            found.append(Checkpoint(p, state["step"], state))
    return sorted(found, key=lambda c: c.step)


def latest_checkpoint(out: Path) -> Checkpoint | None:
    found = checkpoints(out)
    return found[-1] if found else None


def restore(ckpt: Checkpoint, trainer: Checkpointable) -> None:
    """Load a checkpoint into the trainer (adapter, optimizer, scheduler, version) and the global RNGs."""
    saved = torch.load(ckpt.path / "trainer.pt", map_location="cpu", weights_only=True)
    trainer.load_state(ckpt.path, saved["trainer"])
    set_rng_state(saved["rng"])
