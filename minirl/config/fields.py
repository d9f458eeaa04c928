"""The run configuration: one dataclass, one docstring per field. It is the same object as notebook kwargs
(`Config(steps=20)`), YAML (`Config.from_yaml(path)` / `.to_yaml()`) and CLI flags (`--steps 20`). The field
docstrings are the config reference (`cli.field_docs`). Its methods are `base.ConfigMethods`; checks live in
`validate.py`, conversions in `io.py`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minirl.config.base import ConfigMethods
from minirl.config.io import Coercing


@dataclass(frozen=True)
class Config(ConfigMethods, metaclass=Coercing):
    # --- model -------------------------------------------------------------------------------------------
    model: str = "smollm2-135m-instruct"
    """Base model: the embedded default 'smollm2-135m-instruct', a Hugging Face id, or a local folder."""
    dtype: str = "auto"
    """Trainer weights dtype, which the vLLM engine inherits: 'auto' (bfloat16 on GPU, float16 on GPUs below compute
    capability 8.0 such as T4 / V100, float32 on CPU), 'float32', 'bfloat16' or 'float16'."""
    load_in_4bit: bool = False
    """QLoRA: load the frozen base in 4-bit NF4 via bitsandbytes."""
    lora_rank: int = 16
    """LoRA rank r."""
    lora_alpha: int = 32
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] | str = "all-linear"
    """Modules that get LoRA: 'all-linear' or a list of module names such as [q_proj, v_proj]."""

    # --- data and rewards ----------------------------------------------------------------------------------
    data: str = "arithmetic"
    """Prompts (a 'prompt' column: text or chat messages): the built-in task 'arithmetic', a .jsonl, .json, .csv or
    .parquet file, a folder written by `Dataset.save_to_disk`, or 'hf:NAME[:CONFIG][@SPLIT]' (a Hugging Face
    dataset through `datasets.load_dataset`, split 'train' by default; offline, only what the local cache holds)."""
    shuffle: bool = True
    """Take the training prompts in a seeded shuffle, a new one each pass over the data (the default). False takes
    them in the data's own order, pass after pass: to train on the same rows in the same order as another trainer."""
    prompt_column: str = "prompt"
    """Column holding the prompt; every other column reaches reward functions as a keyword argument."""
    system_prompt: str | None = None
    """Optional system message put before each prompt by the chat template."""
    rewards: list[str] = field(default_factory=lambda: ["arithmetic_correct"])
    """Reward functions: registered names (see `minirl.reward`) or 'module:function' paths, each optionally with
    keyword arguments fixed as `name(key=value, ...)` (Python literals), e.g. "overlong_penalty(max_length=48,
    cache_length=16)" (DAPO's soft length penalty) or "format_match(pattern='^<think>')" (1 if the regex is
    found). Besides the data's columns every reward may take `completion_tokens` and `finish_reason` ('stop' |
    'length'); each gets only the keywords its signature names (all with **kwargs)."""
    reward_weights: list[float] | None = None
    """One weight per reward (default all 1). Weight 0 makes a reward a *check*: scored and logged (reward/<name>,
    the samples), never trained on (left out of the summed reward; its failure never fails a sample), and watched by
    the doctor's reward-hacking warnings (docs/rewards-and-sandbox.md). At least one weight must not be 0."""
    reward_timeout_s: float = 10.0
    """A reward call that takes longer is recorded as a failure (timeout) and its sample excluded; with reward
    workers its process is killed and replaced."""
    reward_workers: int = 2
    """Reward calls run in this many worker processes (a reward that crashes, exits or hangs cannot hurt the run;
    a group's calls run in parallel). 0 = in the trainer's process, one after another: only for pure, cheap
    rewards (a hung call cannot be stopped there)."""
    reward_clip: float = 1e6
    """A reward value must be finite and at most this in magnitude, else the call is a failure."""
    reward_memory_mb: int = 2048
    """Memory limit of each reward worker process (a reward past it fails with MemoryError). A CPU reward model or
    local judge loads in each worker: one that cannot fit beside the worker's own torch stops the run before the
    workers start, naming the value it needs."""
    eval_data: str | None = None
    """Held-out prompts for greedy evaluation (the metric is the first reward function): any source `data`
    takes (a file, a saved folder, 'hf:openai/gsm8k:main@test'), or 'arithmetic' (the built-in task's held-out
    problems). None: with the built-in task its own held-out problems,
    else a split carved from `data` (see eval_fraction), disjoint from training."""
    eval_fraction: float = 0.1
    """With no eval_data: the fraction of `data`'s distinct prompts held out for evaluation (chosen by seed, never
    trained on), at most eval_size of them."""
    eval_size: int = 64
    """At most this many held-out prompts are evaluated. 0 = no evaluation (the run says so in one line)."""

    # --- recipes: data columns, model loading, truncation (what a TRL / Unsloth user brings) ----------------
    answer_column: str | None = None
    """A column of `data` / `eval_data` renamed 'answer' before rewards see it (e.g. 'solution'); None = as is."""
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the base model's `from_pretrained`, e.g. {attn_implementation: sdpa,
    revision: main}; `revision` (and `trust_remote_code`) also reach the tokenizer. On the command line:
    --model_kwargs '{attn_implementation: sdpa}'."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose rewards have no spread (all advantages zero) is replaced by a group of
    a fresh prompt until the step holds prompts_per_step informative groups or max_resample_rounds rounds are done
    (then its remaining slots keep groups without spread). Refill prompts are drawn from the training prompts by a
    seeded order of (seed, step, round), none already in the step, so a resumed run draws those of an unbroken one.
    Logged: batch/resampled_groups, batch/informative_groups."""
    max_resample_rounds: int = 3
    """With dynamic_sampling: at most this many refill rounds per step, each generating a group for every slot
    still without spread."""
    train_zero_adv: bool = False
    """Train the samples of groups without a reward spread too, as TRL does: they carry no policy gradient but
    count in loss_agg's denominator (token-mean: their tokens; seq-mean and constant: their sequences), so a step
    whose groups are mostly solved or mostly failed moves the policy less. Off: they are left out (less compute;
    the denominator counts only samples with a gradient). They are always trained when kl_coef > 0 (its term
    needs them)."""
    mask_truncated: bool = False
    """A completion cut by max_tokens (finish_reason 'length'; an episode cut by max_turns / max_episode_tokens)
    contributes no loss; its reward still counts in its group's baseline (DAPO's overlong filtering). Pair it with
    the `overlong_penalty(...)` reward, or use either alone."""

    # --- sampling ------------------------------------------------------------------------------------------
    backend: str = "auto"
    """Generator: 'vllm' (an in-process engine), 'vllm-server' (vLLM OpenAI-compatible servers: num_servers that
    minirl starts, or your own at server_urls), 'hf' (transformers), or 'auto' (vLLM on GPUs, else transformers; on
    3+ GPUs a vLLM server on each GPU the trainer leaves, where servers do all the run asks: docs/gpu.md)."""
    hf_decode: str = "auto"
    """hf generator decoding: 'loop', 'static' (static KV cache, CUDA-graph step: fast_decode.py), 'auto' (loop)."""
    prompts_per_step: int = 8
    """Prompts per optimizer step."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative to the group. Must be >= 2."""
    max_tokens: int = 48
    """Cap on completion length; longer completions are cut (finish_reason 'length')."""
    temperature: float = 1.0
    """Sampling temperature; behaviour and trainer logprobs both use it."""
    top_p: float = 1.0
    """Nucleus sampling; keep 1.0 unless you accept a biased IS ratio (the trainer does not renormalise)."""
    top_k: int = 0
    """Top-k sampling, 0 = off."""
    min_p: float = 0.0
    """Min-p sampling, 0 = off: tokens less likely than min_p times the most likely one (after temperature) are
    never sampled. Same meaning on both backends; the trainer applies the same cut (and renormalises) when it
    scores, so behaviour and trainer logprobs stay the same distribution (unlike top_p / top_k)."""
    repetition_penalty: float = 1.0
    """Penalty > 1 on tokens already in the prompt or the completion so far (1 = off; a seen token's logit is
    divided by it when positive, multiplied when negative, before temperature), as transformers and vLLM define
    it. The trainer applies it to each position from that position's own history when it scores, so the logprobs
    it trains on are the ones sampled with."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: a completion ends where one first appears (its finish_reason is 'stop'; the string is
    dropped from the text rewards see on vLLM, kept on transformers). Evaluation stops at them too."""
    chat_template: str | None = None
    """A chat template (Jinja text, or the path of a file holding it) replacing the tokenizer's own, for training,
    evaluation and episodes alike; None = the tokenizer's."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra variables every chat-template rendering gets (training, evaluation and episodes alike), e.g.
    {enable_thinking: false} for Qwen3."""
    max_prompt_tokens: int = 512
    """Prompts longer than this (after the chat template) are an error."""

    # --- environments: multi-turn episodes (minirl/generation/envs.py, episodes.py) ------------------------
    env: str | None = None
    """Multi-turn environment: a built-in task ('sums': sums of 3-4 numbers with an `add` tool), or a
    'module:Class' path to a `minirl.Env`; None = single-turn prompts. In Python, `Run(cfg, env=MyEnv)` takes the
    class (or any factory) itself. An env run's first reward is `env` (the summed step rewards); `rewards` are
    added to it."""
    max_turns: int = 4
    """An episode ends after this many model replies (recorded as truncated unless the env ended it)."""
    max_episode_tokens: int = 256
    """Cap on an episode's tokens after the prompt (replies and env messages); each reply is also capped by
    max_tokens. An episode with no room for another reply ends, recorded as truncated."""

    # --- optimisation --------------------------------------------------------------------------------------
    steps: int = 40
    """Optimizer steps (policy versions) to run."""
    lr: float = 2e-4
    """AdamW learning rate for the LoRA weights."""
    lr_schedule: str = "constant"
    """'constant' or 'cosine' (to 10% of lr), both after warmup."""
    warmup_steps: int = 0
    """Linear warmup steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm."""
    token_budget: int | str = "auto"
    """Micro-batch size in tokens; gradients accumulate across micro-batches. 'auto': the memory plan's choice
    (`minirl plan CONFIG`): 512 on CPU, on a GPU the largest that fits. With packing 'shared-prefix' it
    counts the real tokens a micro-batch computes (each group's prompt once, plus its completions: no padding);
    with 'padded', rows * longest row (padding included)."""
    packing: str = "shared-prefix"
    """How the trainer lays out a batch: 'shared-prefix' (each group's prompt once, its completions after it,
    each attending to the prompt and itself only; groups packed without padding) or 'padded' (one right-padded
    row per completion: the reference path, and the one used where the attention implementation cannot take a
    custom mask, e.g. flash-attention). Both give the same loss and gradients."""
    gradient_checkpointing: bool | str = "auto"
    """Recompute each decoder layer's activations in backward instead of keeping them: much less memory per
    token for ~30% more training compute. 'auto': on when training on a GPU (as TRL and Unsloth default), off on
    CPU (where memory is rarely the limit and time is); true / false force it."""
    cpu_compact_memory: bool = False
    """On CPU: fix glibc's mmap threshold (process-wide) so that freed activations go back to the system and
    resident memory follows the live tensors (what `minirl plan` counts), instead of the heap keeping up to ~2x
    them. Off by default: every large tensor is then mapped and zeroed anew, which made a demo step ~1.7x slower
    (generation too, as it shares the process; BENCHMARKS.md, "Training speed"). Turn on when RAM, not time, is
    the limit. No effect on GPU."""
    ppo_epochs: int = 1
    """Passes over each batch; each pass is one optimizer step (all at the step's learning rate; the adapter's
    version, staleness and the schedule count run steps). >1 makes the clip ratio active."""

    # --- loss ----------------------------------------------------------------------------------------------
    loss_type: str | None = None
    """A preset by TRL's name for the six fields below (loss_agg, scale_rewards, clip_low, clip_high,
    importance_level, objective): each of them left unset (None) takes the preset's value; one you set (Python, YAML
    or a flag) is yours and stays when loss_type changes. 'grpo': seq-mean, group, clip 0.2 / 0.2, token. 'dr_grpo':
    constant, none, 0.2 / 0.2, token. 'dapo': token-mean, group, 0.2 / 0.28, token. 'bnpo': the same settings as
    'dapo' (TRL's two differ only in counting tokens per device or over the whole step; minirl's weights always span
    the step). 'gspo' (not a TRL loss_type: TRL's GSPO settings under one name): seq-mean, group, 3e-4 / 4e-4,
    sequence. 'cispo': dapo's settings with objective 'cispo'. All but 'cispo' have objective 'ppo-clip'. None:
    'dapo'. Unlike TRL's loss_type, a preset sets the clip range and scale_rewards too. No preset touches kl_coef
    (0 = off, as TRL's beta), tis_cap, behav_clip, opsm_delta or the fields after kl_coef. `cfg.recipe` holds the
    six as resolved; a run's config.yaml writes an unset one as null with the value it resolved to. Table:
    docs/recipes.md."""
    loss_agg: str | None = None
    """Loss aggregation: 'token-mean' (DAPO), 'seq-mean' (GRPO paper) or 'constant' (Dr. GRPO). None: loss_type's."""
    scale_rewards: str | None = None
    """How group-centred advantages are scaled: 'group' (divided by the group's reward std, GRPO), 'batch' (by the
    std of every reward in the step's batch, TRL's 'batch') or 'none' (Dr. GRPO). None: loss_type's, except 'none'
    with advantage_estimator 'rloo' and 'batch' with 'reinforce++' or reward_normalization 'per-reward' (what TRL's
    RLOOTrainer, REINFORCE++ and TRL's normalize_then_sum do). Replaces scale_adv_by_std, still accepted: true =
    'group', false = 'none'."""
    advantage_estimator: str = "group"
    """The baseline each sample's reward is compared with: 'group' (the group's mean: GRPO, Dr. GRPO, DAPO), 'rloo'
    (the mean of the group's other samples, r_i - mean_{j!=i} r_j: RLOO as TRL's RLOOTrainer and SkyRL) or
    'reinforce++' (REINFORCE++-baseline as verl and OpenRLHF: the group's mean subtracted, then divided by the std of
    those centred values over the whole step; scale_rewards unset or 'batch'). scale_rewards then divides 'group' and
    'rloo' advantages as it says. Samples whose reward failed stay out of every baseline and std, with advantage 0;
    groups without spread stay all zeros. Table: docs/recipes.md."""
    reward_normalization: str = "sum"
    """How several rewards make the value the estimator sees: 'sum' (their weighted sum) or 'per-reward' (GDPO, TRL's
    multi_objective_aggregation='normalize_then_sum': each weighted reward centred on its group mean and divided by
    its group std, then weighted and summed, so a reward with a wide range no longer drowns the others). With one
    reward, 'per-reward' feeds the estimator group-standardised rewards. Dynamic sampling judges a group's spread on
    that value."""
    importance_level: str | None = None
    """'token': each token's own ratio. 'sequence' (GSPO): the sequence's length-normalised ratio
    exp(mean_t(logp - old_logp)) replaces the token ratio in the PPO clip, in the capped IS weight (tis_cap, on the
    sequence's mean log ratio to the sampling policy) and in behav_clip, so a sequence is clipped, capped or masked
    whole; each token's gradient flows through the sequence ratio (GSPO-token). opsm_delta is unchanged: it was
    already a per-sequence test (mean |log ratio| to the sampling policy) masking whole sequences. With GSPO's
    clip range behav_clip masks a sequence whose mean log-prob moved more than ~4e-4 since it was sampled (an
    engine whose numerics differ from the trainer's shows it in clip_frac/behav). None: loss_type's."""
    objective: str | None = None
    """'ppo-clip' (PPO's clipped surrogate) or 'cispo' (MiniMax-M1: the ratio to the proximal policy, clipped to
    [cispo_min, cispo_max] and detached, weights each token's -A * logp: a clipped token keeps its gradient). Both
    take tis_cap, behav_clip, opsm_delta, the IS band and importance_level. None: loss_type's."""
    clip_low: float | None = None
    """Lower ratio clip: ratio >= 1 - clip_low. None: loss_type's (0.2 but for 'gspo')."""
    clip_high: float | None = None
    """Upper ratio clip (clip-higher): ratio <= 1 + clip_high. None: loss_type's (0.28 with 'dapo', the default)."""
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap C on pi_trainer / pi_behaviour; None = no correction."""
    opsm_delta: float | None = None
    """Off-policy sequence masking: drop negative-advantage sequences whose mean |log ratio| exceeds this."""
    behav_clip: bool = True
    """Trust region against the policy that sampled the tokens: a token whose probability already moved beyond
    [1 - clip_low, 1 + clip_high] of its sampling probability, in the direction its advantage pushes, gets no
    gradient. Off-policy (K >= 1) it keeps a stale batch from pushing the policy further than PPO would; on-policy
    it does nothing (up to engine/trainer numerics)."""
    kl_coef: float = 0.0
    """Coefficient of the k3 KL to the reference (the base model, adapter disabled). 0 = off."""
    cispo_min: float = 0.0
    """objective 'cispo': its weight's lower bound (1 - eps_low in the paper); 0 = none, as in TRL."""
    cispo_max: float = 5.0
    """objective 'cispo': its weight's cap on the ratio itself (1 + eps_high in the paper); 5.0 is TRL's advice
    for its epsilon_high with loss_type='cispo' (also an absolute cap, ScaleRL's eps_max)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss minus entropy_coef times the mean token entropy (loss_agg's weights, on the tokens
    top_entropy_quantile keeps). 0 = off: no entropy gradient is computed."""
    top_entropy_quantile: float = 1.0
    """TRL's rho: only tokens whose entropy is at or above the (1 - rho) quantile of the step's tokens (at the step's
    start; TRL: per micro-batch) keep the policy term and entropy bonus; the rest still count in the denominator.
    1.0 = every token; 0.0 = the highest-entropy token only."""
    is_mask_low: float | None = None
    """Masked IS (TRL's token_mask / sequence_mask): a token whose IS weight pi_trainer / pi_behaviour (tis_cap's;
    per sequence at importance_level 'sequence') is below this gets IS weight 0, not truncated. None = no bound."""
    is_mask_high: float | None = None
    """Masked IS: a weight above this is masked (is_weight/masked_frac); between tis_cap and it, truncated."""
    loss_fn: str | None = None
    """Your own loss: 'module:function', called once per micro-batch with a `minirl.training.loss.LossInputs` and
    returning a `LossOut` or a scalar tensor (docs/recipes.md, "Your own loss"). None: the built-in
    `minirl.training.loss:decoupled_loss`, which the presets use."""

    # --- async pipeline ------------------------------------------------------------------------------------
    max_async_steps: int | str = "auto"
    """K: generation may run at most K versions ahead of the trainer. 0 = synchronous (on-policy). 'auto': the
    rule in `placement.pick_async_steps` (1 where generation and training have GPUs of their own, generation is on
    your servers, server_urls, or the transformers generator is on a CPU of 2+ cores, a process of its own on half of
    them, for single-turn prompts; else 0: on one shared GPU the phases take turns, multi-turn episodes are
    generation-bound); the run logs the K it chose and why."""
    max_staleness: int | None = None
    """S: groups whose oldest token is more than S versions behind the trainer are dropped. None = keep all."""
    inflight: str = "continue"
    """What in-flight sequences do when a new adapter arrives: 'continue' (finish on the old adapter), 'abort'
    (vLLM: abort them and resubmit prompt + tokens so far under the new adapter) or 'inflight' (vLLM: the adapter
    is swapped in place between engine steps). Every token carries the version that produced it."""

    # --- devices -------------------------------------------------------------------------------------------
    gen_devices: str = "auto"
    """Where generation runs. On GPU: the GPU ids given to the vLLM engine ('1', 'cuda:1', '1,2'; its processes
    see only those). On CPU: the cores the generator is pinned to ('0', '0-3', '0,2'). 'auto': on GPU the engine
    sees every GPU; on CPU, with max_async_steps = 0 nothing is pinned (the two phases take turns, each with every
    core), with K >= 1 the first half of the cores."""
    train_devices: str = "auto"
    """Where training runs. On GPU: the trainer's device ('cuda:0', 'cuda:1'; 'auto' = 'cuda'). On CPU: the cores
    of the trainer's torch threads ('1', '2-3'; 'auto': every core synchronously, the other half with K >= 1)."""
    gpu_memory_utilization: float | str = "auto"
    """vLLM's share of the GPU's memory (weights, activations and KV cache), 0-1. 'auto': sized when the engine
    starts, from the memory free on its GPU then (the trainer has loaded by then): sharing the trainer's GPU, what
    is free less the trainer's training-phase growth (none while the engine sleeps), the engine's CUDA context
    and 8 % headroom; on a GPU of its own 0.9. A run that leaves the engine too little stops in one line. On CPU
    its KV cache is sized by kv_cache_gb instead."""
    kv_cache_gb: float = 1.0
    """vLLM CPU KV-cache size in GiB."""
    sync_transport: str = "auto"
    """How the adapter reaches a vLLM engine: 'ipc' (shared-memory / CUDA IPC handles), 'collective' (gloo /
    NCCL broadcast), 'files' (tmpfs + load), or 'auto' (the fastest that works for the device layout)."""
    verify_sync: bool = True
    """After each adapter push, check that the engine serves it (probe logprobs vs the trainer's)."""

    # --- vLLM servers (backend 'vllm-server') ---------------------------------------------------------------
    num_servers: int = 1
    """How many vLLM servers minirl starts (`vllm serve`, each on a loopback port with a random API key, pinned to
    its own cores or GPU taken from gen_devices; logs in out_dir/servers/). Not used with server_urls. `backend:
    auto` on N >= 3 GPUs sets it to N - 1."""
    server_urls: list[str] = field(default_factory=list)
    """Servers you started yourself (docs/scaling.md: the `vllm serve` command line), e.g.
    ['http://10.0.0.2:8000']; minirl then starts none. Their API key is read from the environment variable VLLM_API_KEY, never from the config
    (which is saved with the run)."""
    restart_servers: bool = False
    """A server minirl started that dies or stops answering is killed, started again and given the current
    adapter, and the groups that were in flight on it are generated again; False: the run stops with an error
    naming the server and its log."""
    server_timeout_s: float = 120.0
    """A server that answers nothing (neither a 1-token request, asked every 2 s, nor any other) for this many
    seconds is down. Too short a timeout declares a slow, loaded server down while it generates
    (BENCHMARKS.md, "Figures moved out of docstrings")."""
    adapter_dir: str | None = None
    """The folder each adapter version is written to for the servers, which must read it at the same path (across
    machines: a shared mount). None: a tmpfs folder for servers minirl starts, out_dir/server_adapters for
    server_urls."""
    server_args: list[str] = field(default_factory=list)
    """Extra `vllm serve` flags for the servers minirl starts, e.g. ['--enforce-eager']."""

    # --- run -----------------------------------------------------------------------------------------------
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    out_dir: str = "runs/minirl"
    """Where the adapter, metrics.jsonl, checkpoints and plots go."""
    eval_samples: int = 0
    """0 = greedy evaluation only. k >= 1: each evaluation also samples k completions per held-out prompt at
    eval_temperature and reports, per reward, mean@k (the mean reward of the samples) and pass@k (the share of
    prompts where at least one of the k samples has a positive reward: the unbiased estimator with n = k samples).
    Costs k times the greedy evaluation's generation."""
    eval_temperature: float = 1.0
    """Sampling temperature of the eval_samples completions."""
    eval_every: int = 0
    """Evaluate held-out accuracy every N steps (0 = only before and after)."""
    checkpoint_every: int = 10
    """Write a checkpoint (adapter, optimizer, scheduler, data position, RNG states) every N steps, 0 = only at
    the end and on stop or error. `minirl train CONFIG --resume` / `Run(cfg, resume=True)` continues from the latest."""
    keep_checkpoints: int = 2
    """How many of the latest checkpoints are kept in out_dir/checkpoints (older ones are deleted)."""
    report_to: str | None = None
    """Also send every step's metrics (the names of metrics.jsonl) to a tracker: 'trackio', 'tensorboard' or
    'wandb' (pip install 'minirl[trackio]' / 'minirl[tensorboard]' / 'minirl[wandb]'; W&B follows its own
    settings, e.g. WANDB_MODE=offline, WANDB_PROJECT). None = metrics.jsonl only."""
    log_samples: int = 4
    """Completions per step written to the log for the sample panel."""
