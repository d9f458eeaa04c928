"""Episodes as a person reads them: the transcript token by token, coloured by what the loss trains on.

    p = minirl.preview_episodes(Guess, rows, n=2)   # the current model plays a few episodes, scored
    p                                                # in a notebook: each episode, trained tokens highlighted
    p.rows                                           # one dict per episode: turns, tools, rewards, advantage, end

Colours: the prompt is grey, the model's sampled tokens (the loss trains on these) green, the env's tokens (its
messages and the template's turn markers, context only) blue. Each token is decoded on its own, so what is shown
is exactly the ids the trainer sees, boundaries included.
"""
from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from minirl.data import rows as D
from minirl.generation.episodes import EpisodeRunner
from minirl.generation.hf import HFGenerator
from minirl.generation.tasks import TASKS, resolve_env
from minirl.rewards import Scorer
from minirl.rewards.advantages import step_advantages
from minirl.types import Completion, SamplingParams, ScoredGroup
from minirl.ui.prototype import load_policy

COLORS = {"prompt": "#eeeeee", "sampled": "#c7f0c2", "env": "#cfe0fb"}


def _token_spans(tok, ids: Sequence[int], kind: str) -> str:
    out = []
    for t in ids:
        text = tok.decode([t])
        shown = html.escape(text).replace("\n", "↵<br>") or "·"
        out.append(f"<span style='background:{COLORS[kind]};border-right:1px solid #fff' "
                   f"title='{kind} token {t}'>{shown}</span>")
    return "".join(out)


def episode_html(tok, prompt_ids: Sequence[int], c: Completion, head: str = "") -> str:
    """One episode: the prompt, then each token after it coloured by its mask (green: trained; blue: env)."""
    mask = c.mask if c.mask is not None else (True,) * len(c.token_ids)
    parts, k = [_token_spans(tok, prompt_ids, "prompt")], 0
    while k < len(mask):
        j = k
        while j < len(mask) and mask[j] == mask[k]:
            j += 1
        parts.append(_token_spans(tok, c.token_ids[k:j], "sampled" if mask[k] else "env"))
        k = j
    legend = " ".join(f"<span style='background:{v};padding:0 4px'>{k}</span>" for k, v in COLORS.items())
    return (f"<div style='margin:6px 0'><div style='font-size:12px'>{html.escape(head)} &nbsp; {legend}</div>"
            f"<div style='font-family:monospace;font-size:12px;line-height:1.6;white-space:pre-wrap'>"
            f"{''.join(parts)}</div></div>")


def episode_text(tok, c: Completion) -> str:
    """The episode after the prompt as text, the trained parts in [[ ]] (for terminals and logs)."""
    mask = c.mask if c.mask is not None else (True,) * len(c.token_ids)
    out, k = [], 0
    while k < len(mask):
        j = k
        while j < len(mask) and mask[j] == mask[k]:
            j += 1
        text = tok.decode(list(c.token_ids[k:j]))
        out.append(f"[[{text}]]" if mask[k] else text)
        k = j
    return "".join(out)


@dataclass
class EpisodePreview:
    """Episodes of the current model, scored like a run scores them (`env` + the reward functions)."""
    groups: list[ScoredGroup]
    tokenizer: Any

    @property
    def rows(self) -> list[dict]:
        out = []
        for gi, sg in enumerate(self.groups):
            for i, c in enumerate(sg.group.completions):
                e = c.episode
                out.append({"group": gi, "episode": i, "turns": e.turns, "end": e.end, "tool_calls": e.tool_calls,
                            "tool_errors": e.tool_errors, "step_rewards": list(e.step_rewards),
                            **{f"reward/{k}": v[i] for k, v in sg.per_reward.items()}, "reward": sg.rewards[i],
                            "advantage": sg.advantages[i], "trained_tokens": sum(c.mask or ()),
                            "env_tokens": len(c.token_ids) - sum(c.mask or ()), "error": e.error})
        return out

    def _repr_html_(self) -> str:
        blocks = []
        for row, (sg, c) in zip(self.rows, [(sg, c) for sg in self.groups for c in sg.group.completions]):
            head = (f"row {row['group']} episode {row['episode']}: {row['turns']} turns, end {row['end']}, "
                    f"tools {row['tool_calls']} ({row['tool_errors']} errors), step rewards {row['step_rewards']}, "
                    f"reward {row['reward']}, advantage {row['advantage']:.2f}")
            if row["error"]:
                head += f", error: {row['error']}"
            blocks.append(episode_html(self.tokenizer, sg.group.prompt.token_ids, c, head))
        return "".join(blocks)

    def __repr__(self) -> str:
        lines = []
        for row, c in zip(self.rows, [c for sg in self.groups for c in sg.group.completions]):
            lines.append(f"row {row['group']} episode {row['episode']}: turns {row['turns']}, end {row['end']}, "
                         f"reward {row['reward']}, advantage {row['advantage']:.2f}")
            lines.append("  " + episode_text(self.tokenizer, c).replace("\n", "\n  "))
        return "\n".join(lines)


def preview_episodes(env: Any, data: Any = None, *, rewards: Sequence[str | Callable] = (),
                     model: str = "smollm2-135m-instruct", adapter: str | Path | None = None, rows: int = 2,
                     n: int = 2, max_turns: int = 4, max_episode_tokens: int = 256, max_tokens: int = 32,
                     temperature: float = 1.0, prompt_column: str = "prompt", seed: int = 0) -> EpisodePreview:
    """Play `n` episodes on each of the first `rows` rows with the current model (+ adapter) and score them.
    `env`: an Env class or factory, or a built-in task's name (then `data` defaults to its held-out rows)."""

    name, factory = resolve_env(env)
    if data is None:
        if name not in TASKS:
            raise ValueError("give `data` (rows, a JSONL path or a Dataset) for an env that is not a built-in task")
        data = TASKS[name].splits(rows, seed)[1]
    m, tok = load_policy(model, adapter)
    runner = EpisodeRunner(HFGenerator(m, tok, merge=False), factory, tok, max_turns, max_episode_tokens)
    prompts = runner.prompts(D.load_rows(data)[:rows], prompt_column)
    groups = runner.generate(prompts, n, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))
    scorer = Scorer.from_config(["env", *[r for r in rewards if r != "env"]], None, 10.0)
    try:
        return EpisodePreview(step_advantages([scorer.score_group(g) for g in groups], "group"), tok)
    finally:
        scorer.close()
