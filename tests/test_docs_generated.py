"""docs/config.md and docs/metrics.md are generated from the code (scripts/gen_docs.py); stale pages fail here."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    """scripts/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gen():
    return _script("gen_docs")


def test_the_generated_references_are_current():
    assert _gen().stale() == [], "run: python scripts/gen_docs.py"


def test_every_field_and_metric_is_in_them():
    import dataclasses

    from minirl.config import Config
    from minirl.core.metrics import METRICS
    gen = _gen()
    config, metrics = gen.config_md(), gen.metrics_md()
    assert all(f"## `{f.name}`" in config for f in dataclasses.fields(Config))
    assert all(f"| `{k}` |" in metrics for k in METRICS)


def test_a_changed_docstring_makes_the_page_stale(tmp_path, monkeypatch):
    """Positive control: the check sees a page that differs from the code."""
    gen = _gen()
    monkeypatch.setattr(gen, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "config.md").write_text(gen.config_md().replace("Config reference", "Config referense"))
    (tmp_path / "docs" / "metrics.md").write_text(gen.metrics_md())
    assert gen.stale() == ["docs/config.md"]


def _plan_table():
    return _script("plan_table")


def test_gpu_md_plan_blocks_are_the_clis_output():
    """docs/gpu.md's plan examples and table are what `minirl plan` prints (faked GPUs: the same on any machine)."""
    assert not _plan_table().stale(), "run: python scripts/plan_table.py"


def test_a_changed_plan_block_is_stale(tmp_path, monkeypatch):
    """Positive control: a figure edited by hand in docs/gpu.md is seen."""
    mod = _plan_table()
    page = tmp_path / "gpu.md"
    page.write_text(mod.PAGE.read_text().replace("peak                  8.87         19.35",
                                                 "peak                  8.87         14.66"))
    monkeypatch.setattr(mod, "PAGE", page)
    assert mod.stale()
