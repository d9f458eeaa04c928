"""Data sources (issue 37 item 5): every file kind made here and read back, a `save_to_disk` folder, `hf:` names
(offline for real: one line; a cached dataset through a stand-in for `datasets.load_dataset`), `answer_column`,
and `model_kwargs` reaching `from_pretrained`."""
import csv
import json
import os
import subprocess
import sys

import pytest

from minirl import Config
from minirl.config.errors import ConfigError
from minirl.data import rows as D
from minirl.data import sources

ROWS = [{"prompt": "What is 1 + 2 ?", "solution": 3}, {"prompt": "What is 2 + 2 ?", "solution": 4}]


def _write(kind: str, path):
    if kind == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    elif kind == "json":
        path.write_text(json.dumps(ROWS))
    elif kind == "json-columns":
        path.write_text(json.dumps({"prompt": [r["prompt"] for r in ROWS], "solution": [r["solution"] for r in ROWS]}))
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, ["prompt", "solution"])
            w.writeheader()
            w.writerows(ROWS)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(ROWS), path)
    elif kind == "saved":
        import datasets
        datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    elif kind == "saved-dict":
        import datasets
        datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                              "test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind,name", [("jsonl", "d.jsonl"), ("json", "d.json"), ("json-columns", "c.json"),
                                       ("csv", "d.csv"), ("parquet", "d.parquet"), ("saved", "saved"),
                                       ("saved-dict", "saved_dict")])
def test_each_file_kind_reads_the_rows_and_renames_the_answer(tmp_path, kind, name):
    src = _write(kind, tmp_path / name)
    rows = D.load_rows(str(src), "prompt", answer_column="solution")
    want = [{"prompt": r["prompt"], "answer": str(r["solution"]) if kind == "csv" else r["solution"]} for r in ROWS]
    assert rows == want  # CSV values are text: rewards convert what they compare
    s = D.make_splits(str(src), str(src), prompt_column="prompt", eval_fraction=0.1, eval_size=1, seed=0,
                      answer_column="solution")
    assert s.train == want and s.eval == want[:1]


def test_bad_sources_are_one_line(tmp_path):
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one written by Dataset.save_to_disk"):
        D.load_rows(str(tmp_path / "plain"))
    (tmp_path / "x.json").write_text('{"prompt": "a"}')
    with pytest.raises(ValueError, match="x.json: a JSON dict; give a list of objects"):
        D.load_rows(str(tmp_path / "x.json"))
    (tmp_path / "x.csv").write_text("question\nhi\n")
    with pytest.raises(ValueError, match=r"x.csv:2: no 'prompt' column"):
        D.load_rows(str(tmp_path / "x.csv"), "prompt")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="x.parquet: not a readable parquet file"):
        D.load_rows(str(tmp_path / "x.parquet"))
    with pytest.raises(ValueError, match=r"data 'nope.parquet': no such file; give a file \(.jsonl, .json, .csv"):
        D.load_rows("nope.parquet")
    with pytest.raises(ValueError, match="data row 1: no 'solution' column"):
        D.load_rows([{"prompt": "a", "solution": 1}, {"prompt": "b"}], "prompt", answer_column="solution")
    with pytest.raises(ValueError, match="has both 'solution' and 'answer'"):
        D.load_rows([{"prompt": "a", "solution": 1, "answer": 2}], "prompt", answer_column="solution")
    saved = _write("saved-dict", tmp_path / "dd")
    import datasets
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(saved))
    with pytest.raises(ValueError, match=r"a DatasetDict without a 'train' split \(splits: \['test'\]\)"):
        D.load_rows(str(saved))


def test_hf_names_parse():
    assert sources.parse_hf("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert sources.parse_hf("hf:openai/gsm8k") == ("openai/gsm8k", None, "train")
    assert sources.parse_hf("hf:org/ds@validation") == ("org/ds", None, "validation")
    with pytest.raises(ValueError, match="no dataset name"):
        sources.parse_hf("hf:")


def test_hf_dataset_offline_and_not_cached_is_one_line(tmp_path):
    """For real: `datasets.load_dataset` with HF_HUB_OFFLINE=1 and an empty cache, in a fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": os.getcwd()}
    code = "from minirl import data; data.load_rows('hf:minirl-test/not-cached:main@train', 'prompt')"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: data 'hf:minirl-test/not-cached:main@train': the dataset "
                           "'minirl-test/not-cached' is not in the local Hugging Face cache"), r.stderr[-2000:]
    assert "save_to_disk" in last


def test_hf_dataset_in_the_cache_is_loaded_with_its_config_and_split(monkeypatch):
    """The cached case with a stand-in for `datasets.load_dataset` (no dataset ships with the tests)."""
    import datasets
    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        return datasets.Dataset.from_list([{"question": "What is 2 + 3 ?", "answer": "#### 5"}])
    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    rows = D.load_rows("hf:openai/gsm8k:main@test", "question")
    assert calls == [("openai/gsm8k", "main", "test")] and rows == [{"question": "What is 2 + 3 ?", "answer": "#### 5"}]


def test_answer_column_and_model_kwargs_in_config(tmp_path):
    c = Config(answer_column="solution", model_kwargs="{attn_implementation: eager, revision: main}")
    assert c.model_kwargs == {"attn_implementation": "eager", "revision": "main"}
    p = tmp_path / "c.yaml"
    c.to_yaml(p)
    assert Config.from_yaml(p) == c
    with pytest.raises(ConfigError, match="model_kwargs: expected a mapping"):
        Config(model_kwargs="[1, 2]")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_model_kwargs_reach_from_pretrained(tiny_model, attn):
    from minirl.training.models import build_model
    model = build_model(Config(model=tiny_model, model_kwargs={"attn_implementation": attn}, lora_rank=4), "cpu")
    assert model.get_base_model().config._attn_implementation == attn
