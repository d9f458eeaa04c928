"""Published model shapes kept in the package, and randomly initialised models of those shapes.

Each `<name>.json` holds the `config.json` values of a published model (Qwen2.5-0.5B/1.5B/7B-Instruct,
Llama-3.2-1B-Instruct) and `qwen2-tiny` a few-layer Qwen2 for tests. `synthetic(name, path)` builds a model of that
shape with random weights and saves it as a normal Hugging Face folder (safetensors + tokenizer), so the memory and
speed of a real size can be measured without a hub. The tokenizer is the small byte-level BPE committed in
`tokenizer/` (1024 tokens, `scripts/make_synthetic_tokenizer.py`); the published vocabulary size is kept (it is
part of the memory), and sampled ids beyond the tokenizer decode to nothing. Random weights: the text is noise, and
rewards are ~0 -- the shapes are for memory, speed and plumbing, not learning.
"""
from minirl.training.shapes.synthetic import NAMES, TOKENIZER, shape_config, synthetic

__all__ = ["NAMES", "TOKENIZER", "shape_config", "synthetic"]
