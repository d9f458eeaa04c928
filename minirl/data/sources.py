"""Where rows come from: a JSONL, JSON, CSV or parquet file, a folder written by `Dataset.save_to_disk`, or a
dataset named `hf:NAME[:CONFIG][@SPLIT]` loaded by `datasets.load_dataset` (from the local cache when offline).

`read_source(spec)` returns the rows as dicts and, where a row has a place a person can find (a file's line), its
name for error messages. Every failure is one `ValueError` naming the source and the fix.
"""
from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

import huggingface_hub.constants as hub_constants

from minirl.core.hub import hub_reachable

FILE_KINDS = ".jsonl, .json, .csv, .parquet"
HF_PREFIX = "hf:"


def parse_hf(spec: str, field: str = "data") -> tuple[str, str | None, str]:
    """'hf:NAME[:CONFIG][@SPLIT]' -> (name, config or None, split; 'train' when not given)."""
    rest = spec[len(HF_PREFIX):]
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise ValueError(f"{field} {spec!r}: no dataset name; write hf:NAME[:CONFIG][@SPLIT], "
                         "e.g. hf:openai/gsm8k:main@train")
    return name, config or None, split or "train"


def read_jsonl(p: Path) -> tuple[list[dict], list[str]]:
    """The objects of a JSONL file and each one's 'file:line'."""
    rows, names = [], []
    with open(p, "rb") as f:
        for k, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{k}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if line.strip():
                try:
                    rows.append(json.loads(line.rstrip("\r\n")))  # a cut line: an unterminated string, not a
                except json.JSONDecodeError as e:  # control character (the newline); "... at" the column
                    if k == 1 and line.lstrip().startswith("["):  # a JSON array (a .json file) named .jsonl
                        raise ValueError(f"{p}:1: starts a JSON array, not one JSON object a line; name the file "
                                         f"{p.with_suffix('.json').name} (a .json file holds a list of objects)"
                                         ) from None
                    at = e.msg if e.msg.endswith(" at") else f"{e.msg} at"
                    raise ValueError(f"{p}:{k}: not valid JSON ({at} column {e.colno}); each line must be one JSON "
                                     "object") from None
                names.append(f"{p}:{k}")
                if not isinstance(rows[-1], dict):
                    raise ValueError(f"{p}:{k}: a JSON {type(rows[-1]).__name__}, not an object; each line must be "
                                     'one JSON object such as {"prompt": "...", "answer": 4}')
    return rows, names


def _read_json(p: Path) -> list:
    """A JSON file holding a list of objects, or an object of equal-length column lists."""
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not a valid JSON file ({e}); give a list of objects, or JSONL (one object per line)") from None
    if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):
        if len({len(v) for v in obj.values()}) != 1:
            raise ValueError(f"{p}: its columns have different lengths; every column list needs one value per row")
        keys = list(obj)
        return [dict(zip(keys, vals)) for vals in zip(*obj.values())]
    if not isinstance(obj, list):
        raise ValueError(f"{p}: a JSON {type(obj).__name__}; give a list of objects such as "
                         '[{"prompt": "...", "answer": 4}] or an object of columns {"prompt": [...], "answer": [...]}')
    return obj


def _read_csv(p: Path) -> list[dict]:
    """A CSV file with a header row; every value is text (rewards convert what they compare)."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{p}:{line}: not UTF-8 text (byte {raw[e.start]:#04x}); save the file as UTF-8 "
                         "(a spreadsheet's 'CSV UTF-8')") from None
    return [dict(r) for r in csv.DictReader(io.StringIO(text, newline=""))]


def _read_parquet(p: Path) -> list[dict]:
    import pyarrow.parquet as pq
    try:
        return pq.read_table(p).to_pylist()
    except Exception as e:  # noqa: BLE001 - a broken file: one line
        raise ValueError(f"{p}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _read_saved(p: Path, split: str = "train", field: str = "data") -> list[dict]:
    """A folder written by `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`: its `split`)."""
    import datasets
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{field} {str(p)!r}: a DatasetDict without a {split!r} split (splits: {sorted(ds)}); "
                             f"save the split you train on, e.g. ds[{sorted(ds)[0]!r}].save_to_disk(...)")
        ds = ds[split]
    return ds.to_list()


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes") or \
        os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes")


def load_hf(spec: str, field: str = "data") -> list[dict]:
    """`hf:NAME[:CONFIG][@SPLIT]` through `datasets.load_dataset`; offline, only what the local cache holds."""
    import datasets
    name, config, split = parse_hf(spec, field)
    # the Hub unreachable: the cache alone, at once (datasets would retry for ~30 s, a log line each time)
    unreachable = not _offline() and not hub_reachable()
    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    try:
        if unreachable:
            datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (ConnectionError, FileNotFoundError, ...)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if unreachable or _offline() or "offline" in first.lower() or isinstance(e, ConnectionError):
            raise ValueError(f"{field} {spec!r}: the dataset {name!r} is not in the local Hugging Face cache and the "
                             "Hub cannot be reached (offline); download it where there is a network, or save it with "
                             "Dataset.save_to_disk and give that folder") from None
        raise ValueError(f"{field} {spec!r}: datasets.load_dataset({name!r}, {config!r}, split={split!r}) failed "
                         f"({type(e).__name__}: {first}); check the name, config and split") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved
    return ds.to_list()


def read_source(spec: str | Path, field: str = "data") -> tuple[list, list[str] | None]:
    """Rows from a file, a saved dataset folder or an `hf:` name, and each row's 'file:line' where it has one.
    `field`: the config field that named it ('data' or 'eval_data'), as errors name it."""
    if isinstance(spec, str) and spec.startswith(HF_PREFIX):
        return load_hf(spec, field), None
    p = Path(spec)
    if p.is_dir():
        if not ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
            raise ValueError(f"{field} {str(spec)!r}: a folder, but not one written by Dataset.save_to_disk "
                             "(no dataset_info.json); give such a folder or a file")
        return _read_saved(p, field=field), None
    if not p.is_file():
        raise ValueError(f"{field} {str(spec)!r}: no such file; give a file ({FILE_KINDS}), a Dataset.save_to_disk "
                         "folder, hf:NAME[:CONFIG][@SPLIT], or a built-in task")
    kind = p.suffix.lower()
    if kind == ".json":
        rows = _read_json(p)
        return rows, [f"{p}: item {k}" for k in range(len(rows))]  # an error names the file and the list's item
    if kind == ".csv":
        rows = _read_csv(p)
        return rows, [f"{p}:{k + 2}" for k in range(len(rows))]  # line 1 is the header
    if kind == ".parquet":
        rows = _read_parquet(p)
        return rows, [f"{p}: row {k}" for k in range(len(rows))]
    return read_jsonl(p)  # .jsonl and anything else: one JSON object per line
