"""`minirl bench sync --out DIR`: adapter sync latency per path and rank, with and without the run's check, and
generation speed while syncing.

The engine is a run's on CPU: float32 (the trainer's dtype there), prefix caching on, `max_lora_rank` = the rank
(one engine per rank), the engine worker on the first core and the trainer on the others (the pipeline's split).
Paths (`PATHS`): `files` (save to tmpfs + vLLM's LoRA load under a new id); `ipc` and `collective` with a run's
default policy `inflight="continue"` (a new LoRA id per push, installed by vLLM's engine call) and with
`inflight="inflight"` (the served id's weights replaced in place, rung on the channel's doorbell). Each with and
without the check a run makes after every push (`verify_sync`, on by default: the trainer's logprobs of the
32-token probe, then `minirl.sync.check.verify`, the engine's version and its logprobs, as `Run._push` calls it); the
check, whose cost does not depend on the path, is timed on the default and the in-place ipc paths at `gen_rank`.

Latency: from the trainer handing over until the engine serves the new weights (and, checked, until the check
passed). The paths are interleaved: each of `rounds` rounds gives every path (x check) a turn of `per_round` timed
pushes, the order reversed every other round; a turn opens with one untimed push (an in-place path installs its
id again: the other paths' pushes retired it; the first turns also open the channels).

Generation while syncing (at `gen_rank`): blocks of `steps` steps (8 story prompts x 2 samples x 24 tokens each),
with no push, a default-path (ipc, continue) push per step, the same and the check, an in-place push per step,
the push issued as the step's generation starts (as the pipeline does); `pairs` rounds of the four, the order
reversed every other round, the prefix cache emptied before each block. The same weights are pushed every time,
so every block samples the same tokens (`identical_fraction`, token by token against the first no-push block).
Writes DIR/sync.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from minirl.benchmarks.compare import empty_prefix_cache, identical_fraction, sequences
from minirl.core.adapter import make_contiguous
from minirl.generation.vllm import VLLMGenerator
from minirl.sync.check import make_probe, verify
from minirl.sync.files import FileSync
from minirl.sync.tensor import TensorSync
from minirl.training.batch import sequence_logprobs
from minirl.training.models import resolve_model
from minirl.types import PolicyTrainer, Prompt, SamplingParams

RANKS = (8, 16, 64)
PATHS = (("files", "continue"), ("ipc", "continue"), ("ipc", "inflight"), ("collective", "continue"),
         ("collective", "inflight"))
CHECKED = (("ipc", "continue"), ("ipc", "inflight"))  # the check's cost is the same on every path: timed on these
BLOCKS = ("none", "continue", "continue+check", "inflight")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def fake_trainer(base, rank: int):
    """The parts of `Trainer` a push and its check use: the peft model (built as the Trainer builds it), its
    version, `logprobs`, `save_adapter`; `bump()` stands in for an optimizer step."""
    pm = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                         task_type="CAUSAL_LM")).eval()
    make_contiguous(pm)  # as the Trainer builds it
    t = types.SimpleNamespace(model=pm, version=0)

    def bump():
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
        t.version += 1

    def save_adapter(path):
        pm.save_pretrained(path)
        return path
    t.bump, t.save_adapter = bump, save_adapter
    t.logprobs = lambda prompt, completion, temperature=1.0: sequence_logprobs(pm, prompt, completion, temperature)
    return t


class Check:
    """The check `Run._push` makes after a push: the trainer's probe logprobs, then `verify` (which raises if the
    engine does not serve the push); each check is the next one's `previous`."""

    def __init__(self, trainer: PolicyTrainer, gen: VLLMGenerator, tok, temperature: float = 1.0):
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}],
                                         add_generation_prompt=True, tokenize=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        self.trainer, self.gen, self.temperature, self.previous = trainer, gen, temperature, None
        self.probe = make_probe(trainer.model, prompt, 32, 0, tok.all_special_ids, len(tok))
        self.dtype = str(next(trainer.model.parameters()).dtype)

    def __call__(self) -> None:
        want = self.trainer.logprobs(*self.probe, self.temperature)
        self.previous = verify(self.gen, self.probe, want, self.trainer.version, self.previous, self.temperature,
                               self.dtype)


def make_path_sync(transport: str, policy: str, timeout_s: float = 60.0):
    if transport == "files":
        return FileSync()
    return TensorSync(transport, inflight=policy == "inflight", timeout_s=timeout_s)


def throughput(gen: VLLMGenerator, rounds: list, push=None, max_tokens: int = 24) -> tuple[float, list]:
    """(Generated tokens/s, the token sequences) over `rounds` (one round = one step's rollouts: a list of prompts,
    2 samples each). With `push`, an adapter sync is issued at the start of every round, concurrently with that
    round's generation (as the async pipeline does). Seeded and restarted per call, so that calls with the same
    rounds sample the same tokens when the weights are the same: a difference is then the cost of the syncs."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=0)
    gen.restart_seeds()
    t0, seqs = time.perf_counter(), []
    for prompts in rounds:
        th = threading.Thread(target=push) if push else None
        fut = gen.submit(prompts, 2, params)
        if th:
            th.start()
        groups = fut.result()
        if th:
            th.join()
        seqs += sequences(groups)
    return sum(map(len, seqs)) / (time.perf_counter() - t0), seqs


def story_rounds(tok, rounds: int, per_round: int = 8) -> list:
    """`rounds` lists of `per_round` chat prompts ("Write a story about the number i."): long, seeded generations
    for measuring generation speed."""

    def chat(i):
        ids = tok.apply_chat_template([{"role": "user", "content": f"Write a story about the number {i}."}],
                                      add_generation_prompt=True, tokenize=True)
        return Prompt(i, tuple(ids if isinstance(ids, list) else ids["input_ids"]), "")
    return [[chat(i) for i in range(per_round * r, per_round * (r + 1))] for r in range(rounds)]


def split_cores() -> tuple[str | None, set[int] | None]:
    """The async pipeline's CPU split for a sync benchmark: the engine worker on the first core, the trainer (this
    thread) on the others. (None, None) with fewer than 2 usable cores."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None, None
    return str(cores[0]), set(cores[1:])


def pin_trainer(cores: set[int] | None) -> None:
    """Bind this (trainer) thread and torch's threads to `cores` (None: leave as is); call after the engine has
    started (an engine started later would inherit it: `unpin` first)."""
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


def latencies(tr: PolicyTrainer, gen: VLLMGenerator, check: Check, rank: int, rounds: int, per_round: int, paths=PATHS,
              checked_paths=CHECKED) -> list[dict]:
    """Every path, and `checked_paths` with the check, interleaved (see the module's docstring): p50/p95 each."""
    syncs = {p: make_path_sync(*p) for p in paths}
    turns = [(p, False) for p in paths] + [(p, True) for p in paths if p in checked_paths]
    times = {t: {"total": [], "push": [], "check": []} for t in turns}
    nbytes, order = {}, []
    try:
        for r in range(rounds):
            this = turns if r % 2 == 0 else turns[::-1]
            order.append([f"{t}/{pol}{'+check' if c else ''}" for (t, pol), c in this])
            for path, checked in this:
                sync = syncs[path]
                if path[1] == "inflight":
                    sync.lora_id = None  # its id was retired when another path served: install it afresh
                tr.bump()
                sync.push(tr, gen)  # the turn's untimed opening push
                for _ in range(per_round):
                    tr.bump()
                    t0 = time.perf_counter()
                    st = sync.push(tr, gen)
                    t1 = time.perf_counter()
                    if checked:
                        check()
                    t2 = time.perf_counter()
                    rec = times[(path, checked)]
                    rec["total"].append((t2 - t0) * 1e3)
                    rec["push"].append((t1 - t0) * 1e3)
                    rec["check"].append((t2 - t1) * 1e3)
                    nbytes[path] = st.bytes
    finally:
        for s in syncs.values():
            s.close()
    out = []
    for (path, checked), rec in times.items():
        ms = rec["total"]
        out.append({"transport": path[0], "inflight": path[1], "check": checked, "rank": rank,
                    "p50_ms": round(statistics.median(ms), 2), "p95_ms": round(_pct(ms, 0.95), 2),
                    "push_p50_ms": round(statistics.median(rec["push"]), 2),
                    **({"check_p50_ms": round(statistics.median(rec["check"]), 2)} if checked else {}),
                    "pushes": len(ms), "bytes": nbytes[path]})
    return [*out, {"rank": rank, "rounds": rounds, "per_round": per_round, "order": order}]


def generation_blocks(tr: PolicyTrainer, gen: VLLMGenerator, check: Check, tok, steps: int, pairs: int,
                      max_tokens: int = 24,
                      per_step: int = 8) -> dict:
    """Generation tokens/s without and with a push per step (see the module's docstring)."""
    syncs = {"continue": make_path_sync("ipc", "continue"), "inflight": make_path_sync("ipc", "inflight")}
    rounds_ = story_rounds(tok, steps, per_step)
    push_ms = {k: [] for k in BLOCKS[1:]}

    def pusher(kind):
        sync = syncs["inflight" if kind == "inflight" else "continue"]

        def push():
            t = time.perf_counter()
            sync.push(tr, gen)
            if kind == "continue+check":
                check()
            push_ms[kind].append((time.perf_counter() - t) * 1e3)
        return push
    tr.bump()
    rates, same, order, reference = {k: [] for k in BLOCKS}, {k: [] for k in BLOCKS}, [], None
    try:
        syncs["continue"].push(tr, gen)
        check.previous = None  # the check's reference is the adapter of these blocks
        check()
        throughput(gen, rounds_[:1], max_tokens=max_tokens)  # warm-up
        for r in range(pairs):
            this = BLOCKS if r % 2 == 0 else BLOCKS[::-1]
            order.append(list(this))
            for kind in this:
                if kind == "inflight":  # its id installed afresh, untimed: the same weights
                    syncs["inflight"].lora_id = None
                    syncs["inflight"].push(tr, gen)
                empty_prefix_cache(gen)
                rate, seqs = throughput(gen, rounds_, None if kind == "none" else pusher(kind), max_tokens)
                reference = reference or seqs
                rates[kind].append(round(rate, 1))
                same[kind].append(identical_fraction(reference, seqs))
    finally:
        for s in syncs.values():
            s.close()
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {"gen_tok_s": {k: round(v, 1) for k, v in med.items()},
            "gen_slowdown_frac": {k: round(statistics.median(1 - b / a for a, b in zip(rates["none"], rates[k])), 4)
                                  for k in BLOCKS[1:]},
            "gen_tok_s_blocks": rates, "gen_identical_fraction": {k: round(statistics.mean(v), 4) for k, v in same.items()},
            "gen_push_p50_ms_under_load": {k: round(statistics.median(v), 2) for k, v in push_ms.items()},
            "gen_order": order, "gen_settings": {"steps_per_block": steps, "pairs": pairs, "prompts_per_step": per_step,
                                                 "n": 2, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0,
                                                 "prefix_cache": "emptied before each block"}}


def bench_sync(out_dir: str, ranks=RANKS, rounds: int = 5, per_round: int = 3, gen_rank: int = 16, steps: int = 2,
               pairs: int = 5, max_tokens: int = 24, per_step: int = 8, paths=PATHS,
               generator: VLLMGenerator | None = None) -> dict:
    """Latency of `paths` at every rank (`latencies`), then at `gen_rank` generation with syncs
    (`generation_blocks`, `per_step` prompts a step). `generator`: a running `VLLMGenerator` to use for every rank
    instead of one engine per rank on the core split (it must take the largest rank; not closed here)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    path = generator.model_path if generator is not None else resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(path)
    results, blocks, orders = [], {}, []
    gen_cores, train_cores = (None, None) if generator is not None else split_cores()
    all_cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    Path(out_dir).mkdir(parents=True, exist_ok=True)

    def write(dtype: str) -> dict:  # after every rank: an interrupted run keeps the ranks it measured
        by = {(r["transport"], r["inflight"], r["check"], r["rank"]): r["p50_ms"] for r in results}
        files = by.get(("files", "continue", False, gen_rank))
        out = {"results": results,
               "speedup_vs_files": {f"{t}/{pol}": round(files / by[(t, pol, False, gen_rank)], 1)
                                    for t, pol in paths if t != "files" and files and (t, pol, False, gen_rank) in by},
               **blocks, "latency_rounds": orders,
               "settings": {"engine_dtype": dtype, "trainer_dtype": "float32", "prefix_caching": True,
                            "max_lora_rank": "= rank (one engine per rank)" if generator is None else "the given engine's",
                            "cores": {"engine": gen_cores, "trainer": sorted(train_cores or [])},
                            "cpu_count": os.cpu_count(), "check": "the run's verify_sync: 32-token probe",
                            "adapter": "all-linear LoRA, lora_alpha = 2 x rank, fresh random lora_B every push"}}
        (Path(out_dir) / "sync.json").write_text(json.dumps(out, indent=2))
        return out
    gen, out = generator, {}
    try:
        for rank in ranks:
            if generator is None:  # one engine per rank, sized to the adapter as a run sizes it
                os.sched_setaffinity(0, all_cores)  # the engine processes must not inherit the trainer's pinning
                gen = VLLMGenerator(path, max_lora_rank=rank, max_model_len=512, kv_cache_gb=1, cpu_cores=gen_cores,
                                    dtype="float32")
                pin_trainer(train_cores)
            try:
                tr = fake_trainer(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), rank)
                check = Check(tr, gen, tok)
                checked = CHECKED if rank == gen_rank else ()  # a check is slow: at one rank only
                *rows, how = latencies(tr, gen, check, rank, rounds, per_round, paths, checked)
                results += rows
                orders.append(how)
                for row in rows:
                    print(json.dumps(row), flush=True)
                if rank == gen_rank:
                    blocks = generation_blocks(tr, gen, check, tok, steps, pairs, max_tokens, per_step)
                gen.load_adapter(None, 0)
                tr.model.unload()
                out = write(gen.dtype)
            finally:
                if generator is None:
                    gen.close()
    finally:
        os.sched_setaffinity(0, all_cores)
        torch.set_num_threads(threads)
    return out


if __name__ == "__main__":
    print(json.dumps(bench_sync(sys.argv[1] if len(sys.argv) > 1 else "runs/bench"), indent=2))
