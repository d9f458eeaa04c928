"""report_to: the real trackio and TensorBoard get every step's metrics under the names of metrics.jsonl, the
held-out accuracy as eval/accuracy with its standard error as eval/accuracy_se, and each step's logged completions
as a table (TensorBoard: a text). Skipped when the package is not installed (the dev extra installs both)."""
import ipaddress
import socket

import pytest
from conftest import TOY_ROWS

from minirl import ConfigError, Run
from minirl.core.metrics import read_log
from minirl.run.trackers import check_tracker

NAMES = ("reward/mean", "length/mean", "time/step_s", "version")


def _logged(out):
    ev = read_log(out)
    return [e for e in ev if e["event"] == "step"], [e for e in ev if e["event"] == "eval"]


def _samples(out) -> dict[int, list[dict]]:
    """Each step's logged completions (the "samples" events), by step."""
    return {e["step"]: e["samples"] for e in read_log(out) if e["event"] == "samples"}


def test_tensorboard_gets_the_metrics_of_the_log(toy_cfg):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    Run(toy_cfg.replace(report_to="tensorboard"), data=TOY_ROWS).run()
    ea = EventAccumulator(toy_cfg.out_dir + "/tensorboard", size_guidance={"tensors": 0})
    ea.Reload()
    steps, evals = _logged(toy_cfg.out_dir)
    for name in NAMES:
        got = [(s.step, s.value) for s in ea.Scalars(name)]
        assert got == [(e["step"], pytest.approx(e[name], rel=1e-6)) for e in steps], name
    assert [(s.step, s.value) for s in ea.Scalars("eval/accuracy")] == [(e["step"], e["accuracy"]) for e in evals]
    assert [(s.step, s.value) for s in ea.Scalars("eval/accuracy_se")] == \
        [(e["step"], pytest.approx(e["accuracy_se"], rel=1e-6)) for e in evals]
    assert "prompt_ids" not in ea.Tags()["scalars"]
    # each step's completions: a markdown table, a row per sample (prompt, completion, reward, ...)
    samples = _samples(toy_cfg.out_dir)
    texts = {t.step: t.tensor_proto.string_val[0].decode() for t in ea.Tensors("samples/text_summary")}
    assert sorted(texts) == sorted(samples) and samples
    for step, rows in samples.items():
        lines = texts[step].splitlines()
        assert lines[0] == "| prompt | completion | reward | advantage | reward/yes_reward |"
        assert len(lines) == 2 + len(rows)
        for line, r in zip(lines[2:], rows):
            assert line.startswith(f"| {r['prompt']} | {r['completion']} | {r['reward']} | ")


def test_trackio_gets_the_metrics_locally_and_touches_no_network(toy_cfg, tmp_path, monkeypatch):
    """trackio writes to its local folder only: no connection leaves the machine, no socket listens."""
    pytest.importorskip("trackio")
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "SPACE_ID"):
        monkeypatch.delenv(var, raising=False)
    import trackio.sqlite_storage
    import trackio.utils
    for mod in (trackio.utils, trackio.sqlite_storage):  # read from the environment at import time
        monkeypatch.setattr(mod, "TRACKIO_DIR", tmp_path / "trackio")
    remote = []
    connect = socket.socket.connect

    def watched(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not ipaddress.ip_address(address[0]).is_loopback:
            remote.append(address)
            raise OSError("network access in a test")
        return connect(self, address)
    monkeypatch.setattr(socket.socket, "connect", watched)

    Run(toy_cfg.replace(report_to="trackio"), data=TOY_ROWS).run()

    assert remote == []
    listening = [c for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert all(ipaddress.ip_address(c.laddr.ip).is_loopback for c in listening), listening
    logs = trackio.sqlite_storage.SQLiteStorage.get_logs("minirl", toy_cfg.out_dir)
    steps, evals = _logged(toy_cfg.out_dir)
    by_step = {}
    for row in logs:
        by_step.setdefault(row["step"], {}).update(row)
    for e in steps:
        for name in NAMES:
            assert by_step[e["step"]][name] == pytest.approx(e[name], rel=1e-9), name
    for e in evals:
        assert by_step[e["step"]]["eval/accuracy"] == e["accuracy"]
        assert by_step[e["step"]]["eval/accuracy_se"] == pytest.approx(e["accuracy_se"], rel=1e-9)
    samples = _samples(toy_cfg.out_dir)
    assert samples
    for step, rows in samples.items():
        table = by_step[step]["samples"]
        assert table["_type"] == "trackio.table"
        assert [(t["prompt"], t["completion"], t["reward"], t["reward/yes_reward"]) for t in table["_value"]] == \
            [(r["prompt"], r["completion"], r["reward"], r["per_reward"]["yes_reward"]) for r in rows]
    assert (tmp_path / "trackio" / "minirl.db").exists()


def test_a_missing_tracker_package_is_one_line_before_the_model_loads(monkeypatch):
    monkeypatch.setattr("minirl.run.trackers.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"report_to='trackio' needs the trackio package: pip install 'minirl\[trackio\]'"):
        check_tracker("trackio")


def _wandb_records(path):
    """The records of an offline W&B run file (`run-ID.wandb`): a 7-byte header, then records in 32 KiB blocks, each
    piece a (crc32c, length, kind) header: kind 1 a whole record, 2/3/4 its first/middle/last piece."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, buf = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of a block is padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(buf)
            out.append(r)
            buf = b""
    return out


def test_wandb_offline_run_folder_holds_the_metrics_of_the_log(toy_cfg, monkeypatch):
    """report_to: wandb with WANDB_MODE=offline: the run folder in out_dir/wandb holds every step's metrics under
    the log's names, eval/accuracy, and the config; no W&B process outlives the run."""
    pytest.importorskip("wandb", reason="wandb is in the dev extra: pip install 'minirl[wandb]'")
    import json
    psutil = pytest.importorskip("psutil")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    cfg = toy_cfg.replace(report_to="wandb")
    Run(cfg, data=TOY_ROWS).run()

    from pathlib import Path
    (f,) = Path(cfg.out_dir, "wandb").glob("offline-run-*/run-*.wandb")
    recs = _wandb_records(f)
    (run,) = [r.run for r in recs if r.WhichOneof("record_type") == "run"]
    assert run.project == "minirl" and run.display_name == cfg.out_dir
    conf = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert conf["lr"] == cfg.lr and conf["report_to"] == "wandb"
    by_step = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            by_step.setdefault(r.history.step.num, {}).update(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
    steps, evals = _logged(cfg.out_dir)
    assert steps
    for e in steps:
        for name in NAMES:
            assert by_step[e["step"]][name] == pytest.approx(e[name], rel=1e-9), name
    for e in evals:
        assert by_step[e["step"]]["eval/accuracy"] == e["accuracy"]
        assert by_step[e["step"]]["eval/accuracy_se"] == pytest.approx(e["accuracy_se"], rel=1e-9)
    samples = _samples(cfg.out_dir)
    assert samples
    for step, rows in samples.items():  # a W&B table a step, its file beside the run's
        ref = {k[len("samples/"):]: v for k, v in by_step[step].items() if k.startswith("samples/")}
        assert ref["_type"] == "table-file" and ref["nrows"] == len(rows)
        table = json.loads((f.parent / "files" / ref["path"]).read_text())
        assert table["columns"] == ["prompt", "completion", "reward", "advantage", "reward/yes_reward"]
        assert [row[:3] for row in table["data"]] == [[r["prompt"], r["completion"], r["reward"]] for r in rows]
    left = []
    for p in psutil.Process().children(recursive=True):
        try:  # a zombie has ended (its parent has not reaped it yet): not left behind
            if p.status() != psutil.STATUS_ZOMBIE and "wandb" in " ".join(p.cmdline()):
                left.append(p.name())
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # it ended while we looked (CI: ZombieProcess here)
            pass
    assert left == [], left


def test_report_to_wandb_is_accepted_and_its_missing_package_is_one_line(monkeypatch):
    from minirl import Config
    assert Config(report_to="wandb").report_to == "wandb"
    monkeypatch.setattr("minirl.run.trackers.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"report_to='wandb' needs the wandb package: pip install 'minirl\[wandb\]'"):
        check_tracker("wandb")
