"""Multi-turn episodes on the transformers generators: the chat delta against both tokenizers (the embedded
SmolLM2's ChatML and the tiny test model's), token-exact episodes turn by turn (K = 0 and K = 1 runs), adapter
swaps between turns, truncation, and envs that fail."""
import math
import sys
import threading

import pytest
import torch

import minirl
from minirl.generation.chat import ChatFormat, TemplateError
from minirl.generation.episodes import EpisodeRunner
from minirl.rewards.advantages import step_advantages
from minirl.training.batch import SampleFilter, make_batch, samples_from_groups
from minirl.types import SamplingParams

ROWS = [{"prompt": f"What is {a} + {b} ?", "answer": a + b} for a in range(6) for b in range(6)]


class Count(minirl.Env):
    """Three replies; the env answers 'no' to each; +1 per reply that says 'yes'."""

    def reset(self, row):
        self.n = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, reply):
        self.n += 1
        return minirl.EnvStep(messages=[{"role": "user", "content": "no"}], reward=float("yes" in reply.split()),
                              done=self.n >= 3)


@pytest.fixture(scope="module")
def smol_tok(embedded_model):
    from minirl.training.models import load_tokenizer
    return load_tokenizer(embedded_model)


@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    from minirl.training.models import load_tokenizer
    return load_tokenizer(tiny_model)


# --- the chat delta ---------------------------------------------------------------------------------------------

CONVERSATION = [{"role": "user", "content": "What is 2 + 3 ?"}, {"role": "assistant", "content": "5"},
                {"role": "user", "content": "no"}, {"role": "assistant", "content": "yes 4"},
                {"role": "user", "content": "a b"}]


@pytest.mark.parametrize("which", ["smol", "tiny"])
def test_appended_ids_equal_the_template_rendering_of_the_whole_chat(which, smol_tok, tiny_tok):
    """Opening + replies ending with EOS (as sampled) + env deltas == the whole conversation rendered and
    tokenized at once: the delta is exactly what the template would add, and nothing before it is rendered again."""
    tok = smol_tok if which == "smol" else tiny_tok
    chat = ChatFormat(tok)
    ids = chat.encode(chat.opening(CONVERSATION[:1]))
    for k in (1, 3):
        reply = chat.encode(CONVERSATION[k]["content"])
        if chat.turn_end.startswith(tok.eos_token):  # ChatML: the sampled EOS is the end of turn
            reply += [tok.eos_token_id]
        ids += reply + chat.env_ids(reply, "stop", CONVERSATION[k + 1:k + 2])
    whole = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ids == chat.encode(whole)


def test_smollm2_end_of_turn(smol_tok):
    chat = ChatFormat(smol_tok)
    assert chat.turn_end == "<|im_end|>\n" and not chat.tool_format
    eos = smol_tok.eos_token_id
    assert chat.reply_end([5, eos], "stop") == "\n"  # the engine stopped on <|im_end|>: only the newline is missing
    assert chat.reply_end([5, 6], "length") == "<|im_end|>\n"  # cut by max_tokens: the whole end of turn
    assert smol_tok.decode(chat.env_ids([5, 6], "length", [])) == "<|im_end|>\n<|im_start|>assistant\n"


def test_templates_that_re_render_earlier_turns_are_refused(tiny_tok):
    import copy
    tok = copy.deepcopy(tiny_tok)
    # like templates that strip the reasoning of earlier replies: a reply renders whole only while it is the last
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
                         "{{ 'A ' + m['content'][:3] + ' ' }}{% else %}{{ m['role'][0]|upper + ' ' + m['content'] + ' ' }}"
                         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'A' }}{% endif %}")
    with pytest.raises(TemplateError, match="re-renders earlier turns"):
        ChatFormat(tok)
    tok.chat_template = ("{{ messages|length }} {% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}"
                         "{% endfor %}{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
    with pytest.raises(TemplateError):
        ChatFormat(tok)
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'A ' + m['content'][:3] + ' ' }}"
                         "{% else %}{{ 'U ' + m['content'] + ' ' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'A' }}{% endif %}")
    with pytest.raises(TemplateError, match="renders an assistant reply differently"):
        ChatFormat(tok)


# --- token-exact episodes -----------------------------------------------------------------------------------

class Spy:
    """Records what a generator was given and what it sampled, request by request (it calls the real one)."""

    def __init__(self, gen):
        self.gen, self.calls, self.inner = gen, [], gen.generate
        gen.generate = self.generate

    def generate(self, prompts, n, params):
        groups = self.inner(prompts, n, params)
        for p, g in zip(prompts, groups):
            for c in g.completions:
                self.calls.append((tuple(p.token_ids), c))
        return groups


def assert_token_exact(batches, calls, min_turns=2):
    """Every trained row is prompt + turns, and each run of trained tokens is one recorded request: the engine was
    given exactly the row before it and sampled exactly those tokens, with those logprobs and versions. The
    tokens between two runs (the env's) are not trained."""
    asked = {}
    for inp, c in calls:
        asked.setdefault(inp, []).append(c)
    rows = turns = 0
    for b in batches:
        for r in range(b.input_ids_B_L.shape[0]):
            n = int(b.attn_B_L[r].sum())
            ids, tgt = b.input_ids_B_L[r, :n].tolist(), b.tgt_mask_B_L[r, :n].tolist()
            runs, k = [], 0
            while k < n:
                if tgt[k]:
                    s = k
                    while k < n and tgt[k]:
                        k += 1
                    runs.append((s, k))
                k += 1
            assert runs and all(not t for t in tgt[: runs[0][0]])
            for s, e in runs:
                sampled = [c for c in asked.get(tuple(ids[:s]), ()) if list(c.token_ids) == ids[s:e]]
                assert sampled, f"row {r}: trained tokens {s}:{e} are no request's output given the row before them"
                c = sampled[0]
                assert b.behav_logp_B_L[r, s:e].tolist() == pytest.approx(list(c.logprobs), abs=1e-6)
                assert b.version_B_L[r, s:e].tolist() == list(c.versions)
            rows += 1
            turns = max(turns, len(runs))
    assert rows and turns >= min_turns


def _env_run(cfg, **kw):
    return minirl.Run(cfg.replace(**kw), data=ROWS[:24], eval_data=ROWS[24:28], env=Count)


@pytest.mark.parametrize("K", [0, 1])
def test_run_trains_on_exactly_the_ids_sampled_turn_by_turn(toy_cfg, monkeypatch, K):
    import minirl.training.trainer as T
    batches = []
    real = T.make_batch
    monkeypatch.setattr(T, "make_batch", lambda *a, **k: batches.append(real(*a, **k)) or batches[-1])
    run = _env_run(toy_cfg, steps=3, max_async_steps=K, max_turns=3, max_episode_tokens=64, max_tokens=5)
    run.setup()
    spy = Spy(run.generator)
    s = run.run()
    assert s["steps"] == 3 and run.cfg.rewards == ["env", "yes_reward"]
    assert_token_exact(batches, spy.calls, min_turns=3)
    h = run.history[-1]
    assert h["episode/turns"] == 3 and h["episode/tool_calls"] == 0 and h["episode/truncated_frac"] == 0
    assert 0 < h["episode/sampled_frac"] < 1 and "reward/env" in h and "reward/yes_reward" in h
    if K == 1:
        assert max(h["staleness/max"] for h in run.history) <= 1


def test_swap_between_turns_is_recorded_in_the_later_turn(tiny_model, tiny_tok, tmp_path):
    """A generator with its own model (the one the K >= 1 pipeline runs in its own process) gets a new adapter
    while an episode waits for the env: the next turn's tokens carry the new version and are sampled by it."""
    from minirl import Config
    from minirl.generation.hf import HFGenerator
    from minirl.training.batch import sequence_logprobs
    from minirl.training.models import build_model
    cfg = Config(model=tiny_model, lora_rank=8, lora_alpha=16)
    model = build_model(cfg, "cpu").eval()
    gen = HFGenerator(model, tiny_tok, merge=False)

    class Swapping(Count):
        def step(self, reply):
            if self.n == 0:  # the trainer pushes version 1 while this episode is at the env
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        if "lora_B" in name:
                            p.add_(0.5)
                gen.set_version(1)
            return super().step(reply)
    runner = EpisodeRunner(gen, Swapping, tiny_tok, max_turns=2, max_episode_tokens=64)
    (p,) = runner.prompts(ROWS[:1])
    (g,) = runner.generate([p], 1, SamplingParams(temperature=1.0, max_tokens=4, seed=3))
    c = g.completions[0]
    first = c.mask.index(False)  # the env's first token
    second = [i for i, m in enumerate(c.mask) if m and i > first]  # the second reply
    assert set(c.versions[:second[0]]) == {0} and {c.versions[i] for i in second} == {1}
    assert g.oldest_version == 0 and c.sampled_versions[-1] == 1
    # the later turn's behaviour logprobs are the new adapter's
    ctx = list(p.token_ids) + list(c.token_ids[: second[0]])
    want = sequence_logprobs(model, ctx, [c.token_ids[i] for i in second], 1.0)
    assert [c.logprobs[i] for i in second] == pytest.approx(want, abs=1e-4)


def test_episode_ends_and_their_records(tiny_model, tiny_tok):
    from minirl import Config
    from minirl.generation.hf import HFGenerator
    from minirl.training.models import build_model
    gen = HFGenerator(build_model(Config(model=tiny_model, lora_rank=8, lora_alpha=16), "cpu").eval(), tiny_tok)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=0)

    class Forever(Count):
        def step(self, reply):
            return minirl.EnvStep(messages=[{"role": "user", "content": "no no no"}], reward=0.5)

    def episodes(env, **kw):
        runner = EpisodeRunner(gen, env, tiny_tok, **{"max_turns": 3, "max_episode_tokens": 200, **kw})
        return runner.generate(runner.prompts(ROWS[:2]), 2, params)

    for g in episodes(Forever):
        for c in g.completions:
            assert c.episode.end == "max_turns" and c.episode.turns == 3 and c.truncated
            assert c.episode.reward == 1.5 and len(c.token_ids) == len(c.mask) == len(c.logprobs) == len(c.versions)
            assert [m["role"] for m in c.episode.messages] == ["user"] + ["assistant", "user"] * 3
    for g in episodes(Forever, max_turns=50, max_episode_tokens=20):
        for c in g.completions:
            assert c.episode.end == "max_episode_tokens" and len(c.token_ids) <= 20 and c.truncated
    for g in episodes(Count):
        assert all(c.episode.end == "done" and c.finish_reason == "stop" for c in g.completions)


class Raises(Count):
    def step(self, reply):
        if self.n == 1:
            raise KeyError("the env broke")
        return super().step(reply)


class BadReturn(Count):
    def step(self, reply):
        return "not an EnvStep"


class BadReward(Count):
    def step(self, reply):
        return minirl.EnvStep(reward=math.nan, done=True)


class StringReward(Count):
    def step(self, reply):
        return minirl.EnvStep(reward="1.0", done=True)  # float() would take it: a number sent as text


class Async(Count):
    async def step(self, reply):
        return super().step(reply)


def test_env_failures_are_recorded_never_raised(tiny_model, tiny_tok):
    from minirl import Config
    from minirl.generation.hf import HFGenerator
    from minirl.rewards import Scorer
    from minirl.training.models import build_model
    gen = HFGenerator(build_model(Config(model=tiny_model, lora_rank=8, lora_alpha=16), "cpu").eval(), tiny_tok)
    scorer = Scorer.from_config(["env"], None, 10.0)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    for env, why in ((Raises, "KeyError: 'the env broke'"), (BadReturn, "expected a minirl.EnvStep"),
                     (BadReward, "reward nan"), (StringReward, "step's reward returned str '1.0', expected a float")):
        runner = EpisodeRunner(gen, env, tiny_tok, max_turns=3, max_episode_tokens=64)
        (g,) = runner.generate(runner.prompts(ROWS[:1]), 2, params)
        for c in g.completions:
            assert c.episode.end == "error" and why in c.episode.error and c.finish_reason == "error"
        [sg] = step_advantages([scorer.score_group(g)], "group")
        assert sg.rewards == (None, None) and sg.advantages == (0.0, 0.0)
        assert all(f.reward == "env" and "EnvError" in f.reason and why in f.reason for f in sg.failures)
        assert samples_from_groups([sg], SampleFilter(keep_zero_adv=True)) == []  # left out of the loss
    runner = EpisodeRunner(gen, Async, tiny_tok, max_turns=3, max_episode_tokens=64)
    (g,) = runner.generate(runner.prompts(ROWS[:1]), 2, params)
    assert all(c.episode.end == "done" and c.episode.turns == 3 for c in g.completions)


def test_reset_must_open_every_episode_of_a_row_alike(tiny_model, tiny_tok):
    import random

    from minirl import Config
    from minirl.generation.hf import HFGenerator
    from minirl.training.models import build_model
    gen = HFGenerator(build_model(Config(model=tiny_model, lora_rank=8, lora_alpha=16), "cpu").eval(), tiny_tok)

    class Drifts(Count):
        def reset(self, row):
            self.n = 0
            return [{"role": "user", "content": random.choice(["yes", "no", "a", "b"])}]
    runner = EpisodeRunner(gen, Drifts, tiny_tok, max_turns=2, max_episode_tokens=64)
    groups = runner.generate(runner.prompts(ROWS[:3]), 4, SamplingParams(max_tokens=3, seed=0))
    errors = [c.episode.error for g in groups for c in g.completions if c.episode.end == "error"]
    assert errors and all("must depend on the row only" in e for e in errors)

    class Broken(Count):
        def reset(self, row):
            raise ValueError("no such row")
    with pytest.raises(ValueError, match="could not open an episode on row 0 .*no such row"):
        EpisodeRunner(gen, Broken, tiny_tok, 2, 64).prompts(ROWS[:1])


def test_batch_trains_only_sampled_tokens_and_staleness_counts_them():
    from minirl.types import Completion, Episode, Group, Prompt, ScoredGroup
    ep = Episode(({"role": "user", "content": "q"},), (1.0,), 2)
    c = Completion((5, 6, 7, 8, 9), (-.1, -.2, 0.0, 0.0, -.3), (3, 3, 1, 1, 4), "x", "stop",
                   (True, True, False, False, True), ep)
    assert c.sampled_versions == (3, 3, 4) and Group(Prompt(0, (1, 2), "q"), (c,)).oldest_version == 3
    sg = ScoredGroup(Group(Prompt(0, (1, 2), "q"), (c,)), (1.0,), {}, (1.0,))
    b = make_batch(samples_from_groups([sg]), 0, "token-mean", 8)
    assert b.tgt_mask_B_L[0].tolist() == [False, False, True, True, False, False, True]
    assert b.n_tokens == 3 and b.weight_B_L[0, 4].item() == 0 and b.weight_B_L[0, 2].item() == pytest.approx(1 / 3)


def test_the_exactness_check_catches_re_tokenized_turns(tiny_model, tiny_tok):
    """The bug class the check exists for: a runner that re-tokenizes each reply's text (instead of appending the
    sampled ids) trains on other ids than the engine sampled, and the check says so."""
    from minirl import Config
    from minirl.generation.hf import HFGenerator
    from minirl.training.models import build_model
    from minirl.types import ScoredGroup

    class ReTokenizes(EpisodeRunner):
        def _take_reply(self, e, c):
            ids = self.chat.encode(c.text)
            e.add(ids, True, list(c.logprobs[: len(ids)]) + [0.0] * (len(ids) - len(c.logprobs)),
                  [c.versions[0]] * len(ids))
            e.turns += 1
            e.messages.append({"role": "assistant", "content": c.text})

    gen = HFGenerator(build_model(Config(model=tiny_model, lora_rank=8, lora_alpha=16), "cpu").eval(), tiny_tok)
    for cls, ok in ((EpisodeRunner, True), (ReTokenizes, False)):
        spy = Spy(gen)
        runner = cls(gen, Count, tiny_tok, max_turns=3, max_episode_tokens=64)
        groups = runner.generate(runner.prompts(ROWS[:4]), 4, SamplingParams(max_tokens=5, seed=1))
        gen.generate = spy.inner
        scored = [ScoredGroup(g, (1.0,) * 4, {}, (1.0,) * 4) for g in groups]
        batch = make_batch(samples_from_groups(scored), 0, "token-mean", 64)
        if ok:
            assert_token_exact([batch], spy.calls, min_turns=3)
        else:
            with pytest.raises(AssertionError, match="no request's output"):
                assert_token_exact([batch], spy.calls, min_turns=3)


def test_dashboard_shows_turns_tool_calls_and_tool_errors_only_for_env_runs():
    """The episodes panel draws its three lines from the `episode/*` metrics; a single-turn run has no such panel."""
    from minirl.ui import render
    steps = [{"step": i, "reward/mean": 0.5, "length/mean": 4.0, "loss": 0.1} for i in range(3)]
    env_steps = [{**h, "episode/turns": 2.0 + i, "episode/tool_calls": 1.5, "episode/tool_errors": 0.25 * i,
                  "episode/truncated_frac": 0.0} for i, h in enumerate(steps)]
    fig = render(env_steps)
    (ax,) = [a for a in fig.axes if a.get_title(loc="left").startswith("episodes")]
    lines = {ln.get_label(): list(ln.get_ydata()) for ln in ax.get_lines()}
    assert lines["turns / episode"] == [2.0, 3.0, 4.0] and lines["tool calls / episode"] == [1.5] * 3
    assert lines["tool errors / episode"] == [0.0, 0.25, 0.5]
    assert not [a for a in render(steps).axes if a.get_title(loc="left").startswith("episodes")]


# --- envs and tools that hang, exit, clash or cannot be made --------------------------------------------------

RELEASE = threading.Event()


class Hangs(Count):
    def step(self, reply):
        RELEASE.wait()  # until the test lets it go: a step stuck on a network call or a lock
        return super().step(reply)


class Exits(Count):
    def step(self, reply):
        sys.exit(3)  # a step that runs the model's code in-process, which called exit()


def run_code(code: str) -> str:
    """Run Python code."""
    exec(code)
    return "ran"


def test_a_step_that_hangs_or_exits_fails_its_episode_and_the_run_goes_on(tiny_model, tiny_tok):
    from minirl import Config
    from minirl.generation.envs import EnvStep
    from minirl.generation.hf import HFGenerator
    from minirl.training.models import build_model
    gen = HFGenerator(build_model(Config(model=tiny_model, lora_rank=8, lora_alpha=16), "cpu").eval(), tiny_tok)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    RELEASE.clear(), RELEASE_RESET.clear()
    try:
        runner = EpisodeRunner(gen, Hangs, tiny_tok, max_turns=3, max_episode_tokens=64, step_timeout_s=0.2)
        (g,) = runner.generate(runner.prompts(ROWS[:1]), 2, params)
        assert all(c.episode.end == "error" and "did not return within 0.2 s" in c.episode.error
                   for c in g.completions)
        runner.make_env = Count  # the runner still works after abandoning the hung thread
        prompts = runner.prompts(ROWS[:1])
        (g,) = runner.generate(prompts, 2, params)
        assert all(c.episode.end == "done" for c in g.completions)
        runner.make_env = ResetHangs
        (g,) = runner.generate(prompts, 2, params)
        assert all(c.episode.end == "error" and "reset did not return within 0.2 s" in c.episode.error
                   for c in g.completions)
    finally:
        RELEASE.set()
        RELEASE_RESET.set()
    runner = EpisodeRunner(gen, Exits, tiny_tok, max_turns=3, max_episode_tokens=64)
    (g,) = runner.generate(runner.prompts(ROWS[:1]), 2, params)
    assert all(c.episode.end == "error" and "step called exit (3)" in c.episode.error for c in g.completions)

    env = minirl.tools([run_code])()  # a tool's exit() is a tool error the model reads, as an exception is
    assert env.call_tool("run_code('exit()')")[0]["content"].startswith("error: SystemExit")
    assert env.tool_errors == 1 and isinstance(env.step("run_code('1')"), EnvStep)


class LoopSampler:
    """A `TurnSampler` on a loop of its own, as the vLLM engine thread is: every reply is "yes" (no model)."""
    version = 0

    def __init__(self, tok):
        import asyncio
        self.ids = tuple(tok.encode("yes", add_special_tokens=False))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    async def sample(self, token_ids, params, seed=None):
        from minirl.types import Completion
        return Completion(self.ids, (0.0,) * len(self.ids), (0,) * len(self.ids), "yes", "stop")

    def call(self, coro):
        import asyncio
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


class ResetHangs(Count):
    def reset(self, row):
        RELEASE_RESET.wait()
        return super().reset(row)


class ResetExits(Count):
    def reset(self, row):
        sys.exit(4)


RELEASE_RESET = threading.Event()


def test_the_loop_runner_fails_an_episode_whose_reset_hangs_or_exits(tiny_tok):
    """vLLM's runner (episodes on the engine loop): a reset that hangs or calls exit() is that episode's recorded
    failure, and the loop goes on (before: a hung reset held the group forever; exit() ended the engine loop)."""
    from minirl.generation.episodes import AsyncEpisodeRunner, make_runner
    sampler = LoopSampler(tiny_tok)
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
    RELEASE_RESET.clear()
    try:
        for env, why in ((ResetHangs, "reset did not return within 0.2 s"), (ResetExits, "reset called exit (4)")):
            runner = make_runner(sampler, Count, tiny_tok, max_turns=3, max_episode_tokens=64, step_timeout_s=0.2)
            assert isinstance(runner, AsyncEpisodeRunner)
            prompts = runner.prompts(ROWS[:1])  # opened by Count: the prompt's own reset works
            runner.make_env = env
            (g,) = runner.generate(prompts, 2, params)
            assert all(c.episode.end == "error" and why in c.episode.error for c in g.completions), \
                [c.episode.error for c in g.completions]
        runner.make_env = Count
        (g,) = runner.generate(prompts, 2, params)
        assert all(c.episode.end == "done" and c.episode.reward == 3.0 for c in g.completions)
    finally:
        RELEASE_RESET.set()


def test_tools_that_clash_and_envs_that_cannot_be_made_fail_in_one_line_before_the_model_loads(toy_cfg, monkeypatch):
    from minirl.generation.tasks import resolve_env

    def add(a: int, b: int) -> int:
        """Add."""
        return a + b
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        minirl.tools([add, add])
    with pytest.raises(ValueError, match="env 'json:__doc__' is str, not a class or factory"):
        resolve_env("json:__doc__")

    class NeedsLevel(Count):
        def __init__(self, level):
            self.level = level

    class ResetStr(Count):
        def reset(self, row):
            return row["prompt"]

    def no_model(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("minirl.run.build.Trainer", no_model)
    for env, why in ((NeedsLevel, r"could not be made \(TypeError: .*level.*functools.partial"),
                     (ResetStr, r"could not open an episode on the first training row .*reset\(row\) must give a list")):
        with pytest.raises(ValueError, match=why):
            minirl.Run(toy_cfg, data=ROWS, env=env, overwrite=True).run()
