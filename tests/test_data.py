"""Data: held-out splits for any data (disjoint from training, deterministic), the seeded prompt order whose state is
one position, and one clear error line naming the file and line for bad rows."""
import json
from pathlib import Path

import pytest
from conftest import TOY_ROWS

from minirl import Run
from minirl.core.metrics import read_log
from minirl.data import rows as D
from minirl.types import Prompt


def test_held_out_split_is_deterministic_disjoint_and_capped():
    rows = [{"prompt": f"q{i % 30}", "answer": i} for i in range(60)]  # every prompt twice
    tr, ev = D.held_out(rows, "prompt", 0.1, 64, seed=0)
    assert len(ev) == 3 and (tr, ev) == D.held_out(rows, "prompt", 0.1, 64, seed=0)
    assert ev != D.held_out(rows, "prompt", 0.1, 64, seed=1)[1]
    assert not {rows[i]["prompt"] for i in tr} & {rows[i]["prompt"] for i in ev}  # a duplicate never leaks
    assert len(tr) == 60 - 6 and len({rows[i]["prompt"] for i in ev}) == 3
    assert len(D.held_out(rows, "prompt", 0.5, 4, seed=0)[1]) == 4  # capped by eval_size
    assert len(D.held_out(rows[:2], "prompt", 0.1, 64, seed=0)[1]) == 1  # at least one, at least one left
    with pytest.raises(ValueError, match="1 distinct prompt"):
        D.held_out([{"prompt": "same"}] * 5, "prompt", 0.1, 64, seed=0)


def test_split_sources(tmp_path):
    kw = dict(prompt_column="prompt", eval_fraction=0.1, eval_size=4, seed=0)
    s = D.make_splits(TOY_ROWS, TOY_ROWS[:10], **kw)
    assert (len(s.train), s.eval, s.eval_ids) == (64, TOY_ROWS[:4], [0, 1, 2, 3])
    s = D.make_splits(TOY_ROWS, None, **kw)
    assert len(s.eval) == 4 and "carved from data" in s.note and sorted(s.train_ids + s.eval_ids) == list(range(64))
    assert [TOY_ROWS[i] for i in s.train_ids] == s.train
    s = D.make_splits("arithmetic", None, **kw)
    assert len(s.eval) == 4 and len(s.train) == 600
    assert D.make_splits(TOY_ROWS, "arithmetic", **kw).eval == D.arithmetic_splits(4, 0)[1]
    for off in (dict(eval_size=0), dict(eval_fraction=0.0)):
        s = D.make_splits(TOY_ROWS, None, **{**kw, **off})
        assert s.eval == [] and "no held-out evaluation" in s.note and len(s.train) == 64
    assert D.make_splits("arithmetic", None, **{**kw, "eval_size": 0}).eval == []


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_arithmetic_split_is_disjoint_by_unordered_pair(seed):
    train, held = D.arithmetic_splits(64, seed)
    pair = lambda r: (min(r["a"], r["b"]), max(r["a"], r["b"]))  # noqa: E731 - (a, b) and (b, a): the same sum
    assert not {pair(r) for r in train} & {pair(r) for r in held}
    assert len(train) == 600 and len(held) == 64


def test_a_large_held_out_set_of_the_builtin_task_finishes_and_a_too_large_one_is_one_line():
    """256 held-out problems once looped forever (600 training problems asked of the ~450 left)."""
    train, held = D.arithmetic_splits(256, 0)
    pair = lambda r: (min(r["a"], r["b"]), max(r["a"], r["b"]))  # noqa: E731
    assert len(held) == 256 and 400 < len(train) < 600 and not {pair(r) for r in train} & {pair(r) for r in held}
    with pytest.raises(ValueError, match="961 problems left to draw, not 2000"):
        D.arithmetic_splits(2000, 0)


def test_prompt_stream_position_is_its_whole_state():
    prompts = [Prompt(i, (), "", {}) for i in range(7)]
    whole = [p.index for p in D.PromptStream(prompts, seed=3).take(40)]
    assert sorted(whole[:7]) == list(range(7)) and sorted(whole[7:14]) == list(range(7))  # epochs
    assert whole[:7] != whole[7:14]  # a new shuffle each epoch
    for k in range(41):
        s = D.PromptStream(prompts, seed=3, position=k)
        assert [p.index for p in s.take(40 - k)] == whole[k:] and s.position == 40


def test_prompt_stream_without_shuffle_takes_the_given_order_pass_after_pass():
    prompts = [Prompt(i, (), "", {}) for i in (4, 0, 6, 2, 5)]
    assert [p.index for p in D.PromptStream(prompts, seed=3, shuffle=False).take(12)] == [4, 0, 6, 2, 5] * 2 + [4, 0]
    s = D.PromptStream(prompts, seed=3, position=7, shuffle=False)  # resumed mid-pass
    assert [p.index for p in s.take(4)] == [6, 2, 5, 4]
    assert [p.index for p in D.PromptStream(prompts, seed=3).take(5)] != [4, 0, 6, 2, 5]  # the default shuffles


def test_bad_rows_name_the_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": 1}\n\n{"answer": 2}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:3: no 'prompt' column \(columns: \['answer'\]\)"):
        D.load_rows(p, "prompt")
    p.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not UTF-8 text \(byte 0xe9 at column 16\); save the file"):
        D.load_rows(p)
    p.write_text('{"prompt": "a"}\n["prompt", "b"]\n')
    with pytest.raises(ValueError, match="d.jsonl:2: a JSON list, not an object"):
        D.load_rows(p)
    with pytest.raises(ValueError, match="data row 1: no 'prompt' column"):
        D.load_rows([{"prompt": "a"}, {"q": "b"}], "prompt")
    j = tmp_path / "d.json"  # a .json file's error names the file and the item, not "data row 0"
    j.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match=r"d.json: item 0: each row must be a dict \(a JSON object\)"):
        D.load_rows(j)
    j.write_text('[{"prompt": "a"}, {"q": "b"}]')
    with pytest.raises(ValueError, match="d.json: item 1: no 'prompt' column"):
        D.load_rows(j, "prompt")


def test_a_run_on_data_alone_evaluates_a_held_out_split(toy_cfg):
    """`Run(cfg, data=rows)` without eval_data: a held-out split is carved and never trained on."""
    s = Run(toy_cfg.replace(steps=2, eval_size=64), data=TOY_ROWS).run()
    assert s["eval_size"] == 6 and s["eval_accuracy_before"] is not None and s["eval_accuracy_after"] is not None
    held = set(D.make_splits(TOY_ROWS, None, prompt_column="prompt", eval_fraction=0.1, eval_size=64,
                             seed=0).eval_ids)
    trained = {i for e in read_log(toy_cfg.out_dir) if e["event"] == "step" for i in e["prompt_ids"]}
    assert trained and not trained & held


@pytest.mark.parametrize("data", [TOY_ROWS, "arithmetic"])
def test_evaluating_nothing_is_explicit_and_says_so(toy_cfg, capsys, data):
    cfg = toy_cfg.replace(steps=1, eval_size=0)
    if data == "arithmetic":
        cfg = cfg.replace(data="arithmetic", rewards=["arithmetic_correct"])
    s = Run(cfg, data=None if data == "arithmetic" else data).run()
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("minirl:")]
    assert out[0] == "minirl: no held-out evaluation (eval_size=0): held-out accuracy is not measured"
    assert len(out) == 3 and out[1].startswith("minirl: placement: hf generation on every core, training on cpu")
    assert out[2].startswith("minirl: plan: ")
    assert s["eval_accuracy_before"] is None and s["eval_size"] == 0
    assert not [e for e in read_log(cfg.out_dir) if e["event"] == "eval"]
    assert json.loads((Path(cfg.out_dir) / "summary.json").read_text())["steps"] == 1


def test_builtin_code_task_rows_are_right_and_scored_in_the_sandbox():
    """Every family's asserts hold for the reference body and fail for a wrong one (one row per family run in
    the sandbox); 'code' loads like a path, with a carved held-out split."""
    from minirl.data.rows import _CODE_FAMILIES, code_rows, load_rows, make_splits
    from minirl.rewards import sandbox
    from minirl.rewards.builtin import code_tests_pass
    rows = code_rows()
    assert len(rows) == 120 == len({r["prompt"] for r in rows}) and rows == load_rows("code", "prompt")
    if sandbox.isolation() == "none":
        pytest.skip("no sandbox isolation on this machine")
    for i, (sig, _, body, _) in enumerate(_CODE_FAMILIES):
        row = rows[12 * i + 4]  # k = 5
        right = f"```python\ndef {sig}:\n    return {body.format(k=5)}\n```"
        wrong = f"def {sig}:\n    return {body.format(k=6)}"
        assert code_tests_pass(row["prompt"], right, row["tests"]) == 1.0, row
        assert code_tests_pass(row["prompt"], wrong, row["tests"]) < 1.0, row
    s = make_splits("code", None, prompt_column="prompt", eval_fraction=0.2, eval_size=64, seed=0)
    assert len(s.eval) == 24 and not {r["prompt"] for r in s.eval} & {r["prompt"] for r in s.train}
