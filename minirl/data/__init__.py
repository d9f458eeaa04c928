"""Data in: where rows come from (`sources.py`: files, `save_to_disk` folders, `hf:` names) and rows made prompts
(`rows.py`: the chat template, held-out splits, the built-in arithmetic task, the prompt stream)."""
from minirl.data.rows import PromptStream, arithmetic_rows, arithmetic_splits, load_rows, make_splits
from minirl.data.sources import read_source

__all__ = ["PromptStream", "arithmetic_rows", "arithmetic_splits", "load_rows", "make_splits", "read_source"]
