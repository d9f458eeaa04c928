"""Build the small byte-level BPE tokenizer committed in minirl/shapes/tokenizer/ (run once; the files are the
artifact). Trained with `tokenizers` on text of this checkout (README, docs) plus arithmetic prompts; 1024 tokens,
Qwen-style chat markers. Synthetic models use it whatever their published vocabulary size: ids beyond it are
never produced by the tokenizer and decode to nothing.

    python scripts/make_synthetic_tokenizer.py
"""
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "minirl" / "shapes" / "tokenizer"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def corpus():
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield from p.read_text().splitlines()
    for a in range(100):
        for b in range(0, 100, 7):
            yield f"What is {a} + {b}? The answer is {a + b}."


def main() -> None:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(corpus(), trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tk.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 32768, "chat_template": CHAT}, indent=1) + "\n")
    print(f"wrote {OUT} ({tk.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
