"""Files a run writes and reads: checkpoint replacement never leaves no checkpoint, everything is fsynced, the
lock file is never followed through a symbolic link, a damaged state.json is one line naming it."""
import os
from pathlib import Path

import pytest

from minirl import ConfigError
from minirl.run import checkpoint as C


class FakeTrainer:
    """What save_checkpoint uses of a trainer; `tag` marks which save a folder came from."""
    def __init__(self, tag: str):
        self.tag = tag

    def adapter_is_finite(self) -> bool:
        return True

    def save_adapter(self, folder: Path) -> None:
        (Path(folder) / "adapter_model.safetensors").write_text(self.tag)
        (Path(folder) / "adapter_config.json").write_text("{}")

    def state_dict(self) -> dict:
        return {"tag": self.tag}


def test_replacing_a_checkpoint_that_fails_midway_keeps_the_old_one(tmp_path, monkeypatch):
    C.save_checkpoint(tmp_path, FakeTrainer("old"), {"step": 12}, keep=2)
    final = tmp_path / "checkpoints" / "step-000012"
    rename = os.rename

    def failing_rename(src, dst, *a, **kw):  # the new folder's rename into place fails
        if Path(dst) == final and Path(src).name.startswith(".step-"):
            raise OSError(28, "No space left on device")
        return rename(src, dst, *a, **kw)
    monkeypatch.setattr(os, "rename", failing_rename)
    with pytest.raises(OSError):
        C.save_checkpoint(tmp_path, FakeTrainer("new"), {"step": 12}, keep=2)
    monkeypatch.setattr(os, "rename", rename)
    ckpt = C.latest_checkpoint(tmp_path)
    assert ckpt is not None and ckpt.step == 12
    assert (ckpt.path / "adapter_model.safetensors").read_text() == "old"
    C.save_checkpoint(tmp_path, FakeTrainer("new"), {"step": 12}, keep=2)  # and a replace that goes through
    assert (C.latest_checkpoint(tmp_path).path / "adapter_model.safetensors").read_text() == "new"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000012"]


def test_a_crash_between_aside_and_in_leaves_the_old_checkpoint_found(tmp_path):
    C.save_checkpoint(tmp_path, FakeTrainer("old"), {"step": 3}, keep=2)
    root = tmp_path / "checkpoints"
    os.rename(root / "step-000003", root / f"{C.ASIDE}step-000003")  # where a kill at that instant leaves it
    ckpt = C.latest_checkpoint(tmp_path)
    assert ckpt.step == 3 and (ckpt.path / "adapter_model.safetensors").read_text() == "old"


def test_checkpoint_and_atomic_writes_fsync_files_and_folders(tmp_path, monkeypatch):
    synced = []
    fsync = os.fsync

    def recording(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)
    monkeypatch.setattr(os, "fsync", recording)
    final = C.save_checkpoint(tmp_path, FakeTrainer("a"), {"step": 1}, keep=2)
    names = {p.name for p in synced}
    assert {"trainer.pt", "state.json", "adapter_model.safetensors", "adapter_config.json"} <= names
    assert final.parent in synced  # the rename into checkpoints/ itself
    assert any(p.parent == final.parent and p.name.startswith(".step-") for p in synced)  # the new folder's entries
    synced.clear()
    C.atomic_text(tmp_path / "summary.json", "{}")
    assert tmp_path in synced and any(p.name.startswith(".summary-") for p in synced)


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").symlink_to(target)
    with pytest.raises(ConfigError, match=r"\.lock' is a symbolic link"):
        C.lock_out_dir(out)
    assert target.read_text() == "keep me"
    (out / ".lock").unlink()
    f = C.lock_out_dir(out)  # a plain lock file still works
    assert (out / ".lock").read_text() == str(os.getpid())
    f.close()


@pytest.mark.parametrize("text,what", [("{\"version\": 3}", "no whole-number 'step'"), ("{bad", "not valid JSON"),
                                       ("[1, 2]", "no whole-number 'step'")])
def test_a_damaged_state_json_is_one_line_naming_the_file(tmp_path, text, what):
    C.save_checkpoint(tmp_path, FakeTrainer("a"), {"step": 5}, keep=2)
    f = tmp_path / "checkpoints" / "step-000005" / "state.json"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        C.latest_checkpoint(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{f}: {what}") and "delete" in msg, msg


def test_overwrite_deletes_only_a_folder_a_run_marked(toy_cfg, tmp_path):
    """A folder holding only the user's config.yaml is not a run: --overwrite refuses in one line, before anything
    loads, and deletes nothing; a folder a run claimed (its marker) is replaced."""
    from conftest import TOY_ROWS

    from minirl import Run
    from minirl.run.checkpoint import RunExists, check_out_dir, clear_run
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("steps: 3\n")
    with pytest.raises(RunExists) as e:
        Run(toy_cfg.replace(out_dir=str(mine)), data=TOY_ROWS, overwrite=True).setup()
    assert "\n" not in str(e.value) and "config.yaml but no minirl run" in str(e.value)
    assert (mine / "config.yaml").read_text() == "steps: 3\n"
    with pytest.raises(RunExists):
        clear_run(mine)  # the deleting function itself checks too
    assert (mine / "config.yaml").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("steps: 3\n")
    (run / "notes.txt").write_text("mine")
    C.mark_run(run)
    check_out_dir(run, resume=False, overwrite=True)
    clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == [C.MARKER, "notes.txt"]
