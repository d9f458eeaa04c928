"""Metric names (a contract shared by tests, dashboard and docs) and the JSONL event log."""
from __future__ import annotations

import json
import math
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from minirl.core.xray import TokenXray
from minirl.types import RunView, ScoredGroup

# name -> meaning. Every "step" event carries these keys (those that apply to the run).
METRICS: dict[str, str] = {
    "step": "optimizer step index (0-based) of this event",
    "version": "policy version after the step",
    "reward/mean": "mean combined reward of included samples",
    "reward/std": "std of the combined reward",
    "reward/failures": "reward calls that failed: raised, crashed, timed out, flooded output, or returned a "
                       "non-number or a value beyond reward_clip",
    "reward/failure_kinds": "those failures by kind, e.g. {'timeout': 2, 'SystemExit': 1}",
    "reward/<name>": "mean of each reward function over the step's samples (before weighting; checks included)",
    "reward/checks": "the rewards of weight 0 (checks: logged as reward/<name>, never trained on), watched by the "
                     "doctor's reward-hacking warnings; only in runs that have checks",
    "length/mean": "mean completion length (tokens)",
    "length/max": "longest completion",
    "length/truncated_frac": "fraction of completions cut by max_tokens",
    "length/repeat_frac": "fraction of completions that repeat a run of 4 tokens (a format feature the reward-hacking "
                          "watch follows: padding, loops)",
    "loss": "policy loss (aggregated)",
    "clip_frac": "fraction of tokens where the clip was active (ppo-clip: the clipped branch; cispo: the IS "
                 "weight at cispo_min or cispo_max)",
    "clip_frac/behav": "fraction of tokens outside the trust region around the sampling policy (behav_clip)",
    "kl_behav": "approx KL(behaviour || trainer), k3 estimator, per token",
    "kl_ref": "approx KL to the reference (adapter disabled), per token",
    "entropy": "mean token entropy of the trainer policy on completions",
    "is_weight/mean": "mean truncated importance weight",
    "is_weight/truncated_frac": "fraction of tokens whose IS weight hit the cap",
    "is_weight/masked_frac": "fraction of tokens whose IS weight left [is_mask_low, is_mask_high]: no policy "
                             "gradient (masked importance sampling)",
    "logprob_mismatch": "mean |trainer logprob - behaviour logprob| per token",
    "staleness/mean": "mean (trainer version - token version) over trained tokens",
    "staleness/max": "max staleness of a trained token",
    "staleness/dropped_groups": "groups dropped as too stale (max_staleness)",
    "groups/zero_adv_frac": "fraction of groups whose advantages are all zero",
    "batch/resampled_groups": "dynamic_sampling: groups generated for fresh prompts to replace groups without reward "
                              "spread at this step",
    "batch/informative_groups": "dynamic_sampling: groups with reward spread (some advantage not zero) trained at "
                                "this step",
    "throughput/gen_tok_s": "generated tokens per second of generation time",
    "throughput/train_tok_s": "trained tokens per second of training time",
    "busy/gen": "fraction of wall time the generator was busy",
    "busy/train": "fraction of wall time the trainer was busy",
    "sync/ms": "adapter push latency (trainer hands over -> engine serves it)",
    "sync/bytes": "adapter bytes pushed",
    "sync/verify_new_diff": "sync check: RMS per token of engine minus trainer probe logprobs under the adapter "
                            "just pushed (small: the engine serves it)",
    "sync/verify_prev_diff": "sync check: the same against the trainer under the reference adapter (the last one "
                             "told apart; ~0: the engine still serves that one)",
    "sync/verify_sep": "sync check: RMS per token of the trainer's probe-logprob move from the reference adapter "
                       "to the new one",
    "sync/verified": "sync check: 1 = the engine serves the new adapter, told apart from the reference; 0 = the "
                     "pushes since moved the probe too little to tell them apart (not an error)",
    "buffer/depth": "groups waiting in the rollout buffer",
    "time/step_s": "wall seconds of this step",
    "time/gen_s": "generation seconds in this step",
    "time/train_s": "training seconds in this step",
    "time/sleep_s": "seconds the vLLM engine took to fall asleep before this step's training (one GPU shared)",
    "time/wake_s": "seconds the vLLM engine took to wake after this step's training, before the push",
    "train/forward_tokens": "tokens one forward pass over the batch computes: padding included (packing 'padded'), "
                            "each segment's prompt once ('shared-prefix'); train/tokens counts those trained on",
    "train/skipped_nonfinite": "optimizer updates skipped because the loss or gradients were not finite",
    "mem/rss_mb": "peak resident memory (MB) of the trainer's process since the previous step: this step's "
                  "generation and training (reward workers and a generator process of its own not included)",
    "mem/cuda_mb": "peak CUDA memory (MB) allocated by torch since the previous step (GPU runs only)",
    "prompt_ids": "indices of the prompts trained on at this step (their rows in the training data)",
    # evaluation ("eval" events and summary.json's eval_before / eval_after hold them as dicts, the standard errors
    # as accuracy_se, greedy_se, ...; the tracker as these names, <reward> being each reward's name)
    "eval/accuracy": "held-out greedy accuracy: the first reward's mean over the eval prompts (a failed score = 0)",
    "eval/greedy/<reward>": "held-out greedy mean of each reward",
    "eval/mean@k/<reward>": "eval_samples = k: mean of each reward over k samples per eval prompt at eval_temperature",
    "eval/pass@k/<reward>": "eval_samples = k: share of eval prompts where at least one of the k samples has a "
                            "positive reward (the unbiased pass@k estimator with n = k samples)",
    "eval/accuracy_se": "standard error of eval/accuracy across the eval prompts: sample std / sqrt(n); the eval "
                        "event's ci95 holds its 95 % interval (Wilson's, as the scores are 0/1)",
    "eval/greedy/<reward>_se": "standard error of eval/greedy/<reward> across the eval prompts",
    "eval/mean@k/<reward>_se": "standard error of eval/mean@k/<reward> across the eval prompts (each prompt's mean "
                               "over its k samples is one value)",
    "eval/pass@k/<reward>_se": "standard error of eval/pass@k/<reward> across the eval prompts (each prompt's "
                               "unbiased pass@k is one value)",
    # environment runs (multi-turn episodes, minirl/generation/episodes.py); absent from single-turn runs
    "episode/turns": "mean model replies per episode",
    "episode/turns_max": "most replies in one episode",
    "episode/tool_calls": "mean tool calls per episode",
    "episode/tool_errors": "mean failed tool calls per episode (unreadable call, no such tool, or the tool raised)",
    "episode/truncated_frac": "fraction of episodes ended by max_turns or max_episode_tokens",
    "episode/env_errors": "episodes whose env raised (recorded failures, left out of the loss)",
    "episode/sampled_frac": "fraction of episode tokens the model sampled (the rest is env context, not trained)",
}


def memory_metrics() -> dict[str, float]:
    """`mem/rss_mb` (and `mem/cuda_mb` on a GPU): this process's peak memory since the last call, whose end starts
    the next window. Linux: the kernel's high-water mark VmHWM, reset through /proc/self/clear_refs (elsewhere the
    process's lifetime peak)."""
    m = {}
    try:
        with open("/proc/self/status") as f:
            m["mem/rss_mb"] = next(int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:"))
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except (OSError, StopIteration):
        m.setdefault("mem/rss_mb", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if torch.cuda.is_available():
        m["mem/cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
        torch.cuda.reset_peak_memory_stats()
    return m


def rollout_metrics(groups: Sequence[ScoredGroup], max_tokens: int) -> dict[str, float]:
    rewards = [r for g in groups for r in g.rewards if r is not None]
    lens = [len(c.token_ids) for g in groups for c in g.group.completions]
    mean = sum(rewards) / len(rewards) if rewards else float("nan")
    m = {
        "reward/mean": mean,
        "reward/std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)) if rewards else float("nan"),
        "reward/failures": sum(len(g.failures) for g in groups),
        "length/mean": sum(lens) / max(1, len(lens)),
        "length/max": max(lens, default=0),
        "length/truncated_frac": sum(c.truncated for g in groups for c in g.group.completions) / max(1, len(lens)),
        "length/repeat_frac": sum(map(repeats, (c.token_ids for g in groups for c in g.group.completions)))
                              / max(1, len(lens)),
        "groups/zero_adv_frac": sum(g.zero_advantage for g in groups) / max(1, len(groups)),
    }
    for name in (groups[0].per_reward if groups else {}):
        vals = [v for g in groups for v in g.per_reward[name] if v is not None]
        m[f"reward/{name}"] = sum(vals) / len(vals) if vals else float("nan")
    m.update(episode_metrics(groups))
    return m


def repeats(ids: Sequence[int], n: int = 4) -> bool:
    """Whether some run of n tokens occurs twice in `ids` (overlaps count)."""
    seen = set()
    for i in range(len(ids) - n + 1):
        key = tuple(ids[i:i + n])
        if key in seen:
            return True
        seen.add(key)
    return False


def episode_metrics(groups: Sequence[ScoredGroup]) -> dict[str, float]:
    """The `episode/*` metrics of an environment run's groups ({} when they hold no episodes)."""
    comps = [c for g in groups for c in g.group.completions if c.episode is not None]
    if not comps:
        return {}
    n, eps = len(comps), [c.episode for c in comps]
    tokens = sum(len(c.token_ids) for c in comps)
    return {"episode/turns": sum(e.turns for e in eps) / n, "episode/turns_max": max(e.turns for e in eps),
            "episode/tool_calls": sum(e.tool_calls for e in eps) / n,
            "episode/tool_errors": sum(e.tool_errors for e in eps) / n,
            "episode/truncated_frac": sum(e.truncated for e in eps) / n,
            "episode/env_errors": sum(e.end == "error" for e in eps),
            "episode/sampled_frac": sum(sum(c.mask or ()) for c in comps) / max(1, tokens)}


def sample_rows(groups: Sequence[ScoredGroup], n: int, xrays: Sequence[TokenXray] = ()) -> list[dict]:
    """The first completion of the first `n` groups, with its scores (a "samples" event, for the sample panel); a
    conversational prompt's messages too (`rescore` gives them to batched rewards); its token X-ray as "xray" where
    `xrays` has one of its tokens (`Trainer.xrays`, in the same order: `minirl.xray` shows it)."""
    rows = []
    for k, g in enumerate(groups[:n]):
        c, msgs = g.group.completions[0], g.group.prompt.messages
        rows.append({"prompt": g.group.prompt.text, "columns": g.group.prompt.columns, "completion": c.text,
                     "reward": g.rewards[0], "per_reward": {k: v[0] for k, v in g.per_reward.items()},
                     "advantage": g.advantages[0], "failures": [f.__dict__ for f in g.failures],
                     **({"messages": [dict(m) for m in msgs]} if msgs is not None else {}),
                     **({"xray": xrays[k].to_row()} if k < len(xrays) and xrays[k].token_ids_T == c.token_ids
                        else {})})
    return rows


def step_summary(history: Sequence[dict]) -> dict[str, Any]:
    """A run's summary figures from its step events: steps, median step seconds, mean reward of the first and the
    last k steps (k = a quarter of the steps, 1..5)."""
    rewards = [h["reward/mean"] for h in history]
    times = [h["time/step_s"] for h in history]
    k = max(1, min(5, len(rewards) // 4))
    return {"steps": len(history), "median_step_s": statistics.median(times) if times else None,
            "reward_first": _mean(rewards[:k]), "reward_last": _mean(rewards[-k:])}


def _mean(xs: Sequence[Any]) -> float | None:
    xs = [x for x in xs if x is not None and x == x]
    return sum(xs) / len(xs) if xs else None


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLog:
    """Append-only JSONL: one JSON object per event, flushed at once so a crash loses nothing written. `append`
    (a resumed run) continues the file and its clock, so times stay increasing across the resume."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        last = _last_time(self.path) if append else 0.0
        self._f = open(self.path, "a" if append else "w", buffering=1)
        if append and not _ends_a_line(self.path):
            self._f.write("\n")  # a killed writer's half line stays a line of its own (skipped by readers)
        self._lock = threading.Lock()
        self.t0 = time.time() - last

    def log(self, event: str, **fields: Any) -> dict:
        rec = {"event": event, "time": round(time.time() - self.t0, 4), **{k: _clean(v) for k, v in fields.items()}}
        with self._lock:
            self._f.write(json.dumps(rec, default=str) + "\n")
        return rec

    def close(self) -> None:
        self._f.close()


def _ends_a_line(path: Path) -> bool:
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            return True
        f.seek(-1, 2)
        return f.read(1) == b"\n"


def _last_time(path: Path) -> float:
    try:
        events = read_log(path)
    except FileNotFoundError:
        return 0.0
    return max((e.get("time") or 0.0 for e in events), default=0.0)


def supersede(events: list[dict], resume: dict) -> list[dict]:
    """The events a resume leaves standing: a run resumed from a checkpoint after `resume["step"]` steps redoes the
    later steps, so the first attempt's step, samples and later eval (and eval_problems) events of those steps are
    dropped."""
    s = resume.get("step") or 0

    def gone(e: dict) -> bool:
        step = e.get("step")
        if step is None:
            return False
        return (e["event"] in ("step", "samples") and step >= s) or \
            (e["event"] in ("eval", "eval_problems") and step > s)
    return [e for e in events if not gone(e)]


class LogTail:
    """Incremental reader of a JSONL log that another thread is appending to: only complete lines are read."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._pos = 0
        self._buf = b""
        self.events: list[dict] = []

    def poll(self) -> list[dict]:
        """Read what was appended since the last call; return the new events."""
        try:
            if self.path.stat().st_size < self._pos:  # truncated: a new run rewrote the log
                self._pos, self._buf, self.events = 0, b"", []
            with open(self.path, "rb") as f:
                f.seek(self._pos)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._pos += len(chunk)
        data = self._buf + chunk
        lines = data.split(b"\n")
        self._buf = lines.pop()  # an incomplete last line waits for the next poll
        new = []
        for line in lines:
            if line.strip():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        for e in new:
            if e.get("event") == "resume":
                self.events = supersede(self.events, e)
            self.events.append(e)
        return new



def log_path(path: str | Path) -> Path:
    """The metrics.jsonl that `path` names (the file, or the run folder holding it); FileNotFoundError if none."""
    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    elif p.is_file() and p.suffix != ".jsonl":  # config.yaml, summary.json: the folder was meant
        raise ValueError(f"{p}: not a metrics log; give the run's folder ({p.parent}) or its metrics.jsonl")
    if not p.exists():
        raise FileNotFoundError(f"{p}: no metrics log here; give a run's out_dir or its metrics.jsonl")
    return p


def read_log(path: str | Path) -> list[dict]:
    """Every complete event of a run's log (`metrics.jsonl`, or the run folder holding it); after a resume, the
    resumed run's events replace those of the steps it redid (`supersede`)."""
    tail = LogTail(log_path(path))
    tail.poll()
    return tail.events


def load_events(source: str | Path | Sequence[dict] | RunView) -> list[dict]:
    """Events from a path (metrics.jsonl or its run folder), a list (events or step records), or a run (`RunView`:
    a live `Run`)."""
    if isinstance(source, (str, Path)):
        return read_log(source)
    if isinstance(source, (list, tuple)):
        return [e if "event" in e else {"event": "step", **e} for e in source]
    return source.events()


def steps(events: list[dict]) -> Iterator[dict]:
    return (e for e in events if e["event"] == "step")
