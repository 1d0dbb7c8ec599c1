"""The pipeline configuration: one YAML file, validated into frozen pydantic models.

Every knob that changes what is generated or how it is judged lives here, so a run's manifests
can record it and a rerun with the same config reproduces the same keys. The models refuse what
they do not know (`extra="forbid"`): a mistyped gate threshold must stop the run, not silently
fall back to its default and turn the gate off. Every bad key is reported, one line each, with
its dotted path and the nearest valid key.

Trigger-form params are applied with `PipelineConfig.with_overrides`, which goes through the same
validation as the file; the DAG's trigger form (plugins/eagle3_airflow.py) takes each param's
type, enum, bounds and description from these same fields, so the form and the file cannot drift.

Where the default file is: `eagle3_data/defaults/pipeline.yaml`, package data (a wheel install
has it). Sources (`tokenizer.source`, `model.source`) are a local path (relative paths resolve
against the config file's directory), an `s3://` prefix, or `dev:NAME`, one of the builds
`eagle3_data.builds.sources` makes offline (the real Kimi tokenizer, the tiny DeepSeek-V3): the
packaged default is a dev config that runs anywhere; production points `$EAGLE3_CONFIG` at its own.
"""

from __future__ import annotations

import copy
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, ValidationInfo, field_validator

from eagle3_data.errors import UserError

# The gate's default thresholds, in one place (validate.py's library defaults use these too).
from eagle3_data.gate_defaults import (
    DEFAULT_MAX_BAD_ROW_RATE,
    DEFAULT_MAX_BILLING_DEVIATION,
    DEFAULT_MAX_BPE_MISMATCH_RATE,
    DEFAULT_MAX_IDENTITY_MISMATCH_RATE,
    DEFAULT_MAX_MISSING_USAGE_RATE,
    DEFAULT_MAX_PROMPT_BILLING_MEAN_ABS_DIFF,
    DEFAULT_MAX_PROMPT_BILLING_ROW_DIFF,
    DEFAULT_MAX_PROMPT_BILLING_ROW_RATE,
    DEFAULT_MAX_REJECTED_PROMPT_RATE,
    DEFAULT_POLICY_FALSE_ALARM_RATE,
    DEFAULT_POLICY_POWER,
    DEFAULT_POLICY_SHIFT_NATS,
)

CONFIG_ENV = "EAGLE3_CONFIG"
DEV_SOURCE_SCHEME = "dev:"

RoutingStrategy = Literal["fraction", "capacity", "balanced"]
LengthPolicy = Literal["truncate", "drop"]
LayerConvention = Literal["output", "input"]
LocalEngine = Literal["sglang", "vllm"]
HiddenStatesBackend = Literal["transformers", "vllm"]
StorageDtype = Literal["bf16", "fp32", "compute"]
# What a dev config may run on instead of the real thing (stand_ins): recorded in every manifest,
# the run report and the Asset event, so nobody trains on a stand-in run unknowingly.
StandIn = Literal["tokenizer", "model", "local_engine", "overflow_provider"]
STAND_INS: tuple[str, ...] = get_args(StandIn)
ROUTING_STRATEGIES: tuple[str, ...] = get_args(RoutingStrategy)
LENGTH_POLICIES: tuple[str, ...] = get_args(LengthPolicy)
LAYER_CONVENTIONS: tuple[str, ...] = get_args(LayerConvention)
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


Rate = Annotated[float, Field(ge=0.0, le=1.0)]


class _Model(BaseModel):
    """Frozen, strict (no bool-as-int, no "1" as 1), and refusing unknown keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_section(cls, value: Any, info: ValidationInfo) -> Any:
        """A section left empty in YAML (`routing:` with every line commented out) is null: read
        it as an empty mapping, i.e. all defaults."""
        if value is None and info.field_name is not None:  # a field validator always has its field's name
            annotation = cls.model_fields[info.field_name].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                return {}
        return value


class StorageConfig(_Model):
    bucket: str = Field(description="S3 bucket of every artifact (created by `eagle3-data s3 init`)")
    prefix: str = Field("eagle3-datagen", description="key prefix inside the bucket")

    @field_validator("prefix")
    @classmethod
    def _strip(cls, v: str) -> str:
        return v.strip("/")


class TokenizerConfig(_Model):
    source: str = Field(description="HF tokenizer dir, s3:// prefix holding one, or a dev: build (dev:kimi-tokenizer)")
    expected_special_ids: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="ids to audit beyond the model family's published ones (chat_format: each family's "
        "reference_ids, always audited): encode(name) == [id] and decode([id]) == name, before any spend",
    )


class ModelConfig(_Model):
    name: str = Field(description="recorded in provenance and hidden-state metadata")
    source: str = Field(
        description="HF model dir, s3:// prefix, or dev:tiny-kimi-k25 / dev:tiny-deepseek-v3 (hidden-state extraction)"
    )
    family: str | None = Field(
        None,
        description="the model family whose output format renders and parses its generations (a chat_format "
        "module's name); unset: the one whose special tokens the tokenizer carries; set: a tokenizer of another "
        "family is refused",
    )

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str | None) -> str | None:
        from eagle3_data.chat_format import FORMATS

        if value is not None and value not in FORMATS:
            raise ValueError(f"unknown model family {value!r}; known: {', '.join(FORMATS)}")
        return value


class SamplingConfig(_Model):
    """Part of every sample_id: changing it makes new samples, never overwrites old ones.

    Every key is sent to every engine explicitly (SGLang's /generate, vLLM's completions and
    OpenRouter), because the engines fill an unset key differently: vLLM from the model's
    generation_config.json, SGLang's /generate from its own neutral defaults. The keys added
    after the first four are left out of sample ids while at their neutral values (listed in
    `NEUTRAL_SAMPLING`), so ids made before them stay the same."""

    temperature: float = Field(1.0, ge=0.0, le=2.0, description="sampling temperature")
    top_p: float = Field(1.0, ge=0.0, le=1.0, description="nucleus sampling mass")
    max_new_tokens: int = Field(2048, ge=1, le=262_144, description="generation length cap per sample")
    thinking: bool = Field(True, description="generate with the model's thinking section")
    top_k: int = Field(-1, ge=-1, description="sample from the k most likely tokens; -1: the whole vocabulary")
    min_p: float = Field(
        0.0, ge=0.0, le=1.0, description="drop tokens below min_p x the most likely token's probability"
    )
    repetition_penalty: float = Field(
        1.0, gt=0.0, le=2.0, description="multiplicative penalty on repeated tokens (1: none)"
    )
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="additive penalty on tokens present so far")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="additive penalty per occurrence so far")
    sampling_seed: int | None = Field(
        None,
        ge=0,
        description="the engines' sampling seed (the same for every sample; empty: each request draws its own)",
    )

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("0 is no top-k for one engine and greedy for another: use -1 for the whole vocabulary")
        return v


# The sampling keys whose neutral value leaves sample ids as they were before the key existed.
NEUTRAL_SAMPLING = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "sampling_seed": None,
}


class LocalGenerationConfig(_Model):
    engine: LocalEngine = Field("sglang", description="local inference engine behind the endpoints")
    images: bool = Field(
        False,
        description="the local endpoints serve the vision-language target with its image processor and take "
        "image prompts (SGLang's /generate with image_data; `vllm serve --enable-scale-out`'s "
        "/inference/v1/generate): image prompts are routed as text ones are; false: every image prompt goes "
        "to overflow (docs/images.md)",
    )
    in_flight_per_endpoint: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="concurrent requests per endpoint; unset: the endpoint's reported capacity "
        "(SGLang /server_info max_running_requests), else 64 (vLLM reports none)",
    )
    rows_per_part: int = Field(256, ge=1, le=1_000_000, description="checkpoint every N samples")
    warmup_timeout_s: float = Field(600.0, gt=0, description="how long to wait for endpoints to become ready")
    unreachable_timeout_s: float = Field(
        15.0,
        gt=0,
        description="an endpoint that accepts no connection for this long (nothing listening, no route) "
        "is reported dead before dispatch; one that answers (503 while it loads) is waited for up to warmup_timeout_s",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="bound on one TCP connection attempt to an endpoint")
    max_endpoint_failures: int = Field(3, ge=1, description="consecutive failures before an endpoint is dropped")
    served_model: str | None = Field(
        None,
        description="the model name every local endpoint must serve (its GET /v1/models); an endpoint serving "
        "another is not used, an answer naming another is an identity_mismatch row; unset: recorded, not checked",
    )


class PriceConfig(_Model):
    prompt: float = Field(0.0, ge=0.0, description="USD per million prompt tokens")
    completion: float = Field(0.0, ge=0.0, description="USD per million completion tokens")


class OverflowGenerationConfig(_Model):
    model: str = Field(description="OpenRouter model slug")
    provider: dict[str, Any] = Field(
        default_factory=dict, description="OpenRouter provider routing (order, allow_fallbacks, ...)"
    )
    concurrency: int = Field(256, ge=1, le=4096, description="concurrent OpenRouter requests per task")
    max_usd: float = Field(10.0, ge=0.0, description="Hard OpenRouter spend cap per dataset in this run (USD).")
    price_usd_per_mtok: PriceConfig = Field(
        default_factory=PriceConfig, description="prices answers without usage.cost and dry-run estimates"
    )
    rows_per_part: int = Field(64, ge=1, le=1_000_000, description="checkpoint every N samples")
    unreachable_timeout_s: float = Field(
        15.0, gt=0, description="the base URL accepting no connection for this long is reported before dispatch"
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="bound on one TCP connection attempt to the base URL")
    max_identical_errors: int = Field(
        10,
        ge=1,
        description="this many identical permanent errors in a row (a 400 for a parameter the provider "
        "refuses) stop dispatch with that error instead of failing the dataset row by row; a prompt's own refusal "
        "(moderation, too large) never counts",
    )
    stream: bool = Field(
        True,
        description="SSE requests: bounded by the silence between bytes, not the answer's length, and named "
        "(X-Generation-Id) as they open, so a cut one is priced from OpenRouter's record instead of paid again unseen",
    )
    stream_idle_timeout_s: float = Field(
        180.0,
        gt=0,
        description="a stream silent this long (no token, no keep-alive comment) is cut and priced; "
        "OpenRouter sends keep-alives while a provider prefills, so this bounds a dead stream, not a long answer",
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="stream: false only: the whole answer's time (a Kimi-K2.5 answer with 16k+ "
        "reasoning tokens can take longer; the request it cuts is billed and counted at the budget's estimate)",
    )
    record_wait_s: float = Field(
        60.0,
        ge=0,
        description="before the manifest: how long to keep asking GET /generation?id= for the records of the "
        "attempts counted at the budget's estimate (cut or errored streams whose record was not there yet); each "
        "record found replaces its estimate in the stage's spend, one still missing stays at the estimate; 0: none",
    )


Regenerate = Literal["final_turn", "every_turn", "trajectory"]
History = Literal["dataset", "regenerated"]
CallIds = Literal["format", "given"]


class GenerationConfig(_Model):
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    repeats: int = Field(1, ge=1, le=64, description="samples per prompt")
    regenerate: Regenerate = Field(
        "final_turn",
        description="final_turn: one sample per row, the answer after its whole history; every_turn: one "
        "sample per user turn, the answer after the history up to it (the dataset's own earlier turns, as the template "
        "renders them there); trajectory: one sample per user turn, the assistant turns regenerated in order, each "
        "tool call that matches a recorded one (name, JSON-equal arguments) answered with its recorded result, the "
        "first one without a result ending the trajectory",
    )
    history: History = Field(
        "dataset",
        description="every_turn and trajectory: the history before a user turn is the dataset's own "
        "(dataset) or the answers regenerated before it (regenerated, on-policy)",
    )
    call_ids: CallIds = Field(
        "format",
        description="the tool-call ids of the prompts' history: format rewrites a dataset's own (call_w1, "
        "ShareGPT's call_0) to the ones the model writes (its format's call_id, counting the row's calls), each "
        "tool result re-keyed to the call it answers, since a model may read a call's function name from its id; "
        "given keeps them as the dataset has them",
    )
    max_trajectory_steps: int = Field(8, ge=1, le=256, description="trajectory: assistant turns per user turn at most")
    local: LocalGenerationConfig = Field(default_factory=LocalGenerationConfig)
    overflow: OverflowGenerationConfig


class RoutingConfig(_Model):
    strategy: RoutingStrategy = Field(
        "fraction",
        description="fraction: overflow_fraction of samples go to OpenRouter; capacity: the local "
        "endpoints take routing.local_capacity samples and the rest overflows; balanced: split so local and "
        "overflow, running at once, finish together (local_endpoints x in_flight_per_endpoint / local_latency_s "
        "against overflow concurrency / overflow_latency_s).",
    )
    overflow_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="Share of samples generated on OpenRouter (strategy=fraction)."
    )
    local_capacity: int = Field(
        0, ge=0, description="strategy=capacity: samples the local endpoints take per dataset and run"
    )
    calibration_samples: int = Field(0, ge=0, description="generated on both paths to compare them")
    local_endpoints: int = Field(
        1, ge=0, description="strategy=balanced (and the plan): local engine endpoints serving the run"
    )
    local_latency_s: float = Field(
        60.0,
        gt=0,
        description="strategy=balanced (and the plan): observed seconds per local sample at "
        "generation.local.in_flight_per_endpoint requests in flight (a previous run's or a calibration's)",
    )
    overflow_latency_s: float = Field(
        6.0,
        gt=0,
        description="strategy=balanced (and the plan): observed seconds per OpenRouter request "
        "(at generation.overflow.concurrency in flight)",
    )


class ValidationConfig(_Model):
    """Gate thresholds; a dataset's `validation:` overrides single fields of the global ones."""

    max_bpe_mismatch_rate: Rate = Field(
        DEFAULT_MAX_BPE_MISMATCH_RATE,
        description="Gate: max share of local samples whose ids differ from re-encoding only by BPE merges.",
    )
    max_billing_deviation: Rate = Field(
        DEFAULT_MAX_BILLING_DEVIATION,
        description="Gate: max |billed - reconstructed| / billed completion tokens on overflow rows.",
    )
    max_prompt_billing_mean_abs_diff: float = Field(
        DEFAULT_MAX_PROMPT_BILLING_MEAN_ABS_DIFF,
        ge=0.0,
        description="Gate: max mean |billed - ours| prompt tokens per overflow answer (usage.prompt_tokens against the "
        "prompt ids we train on): a provider rendering another prompt (an injected system prompt, tools declared "
        "another way) fails it",
    )
    max_prompt_billing_row_diff: int = Field(
        DEFAULT_MAX_PROMPT_BILLING_ROW_DIFF,
        ge=0,
        description="Gate: an overflow answer whose billed prompt tokens differ from its prompt ids by more than this "
        "is over the tolerance (see max_prompt_billing_row_rate)",
    )
    max_prompt_billing_row_rate: Rate = Field(
        DEFAULT_MAX_PROMPT_BILLING_ROW_RATE,
        description="Gate: max share of overflow answers over max_prompt_billing_row_diff "
        "(default 0: any fails, named)",
    )
    max_rejected_prompt_rate: Rate = Field(
        DEFAULT_MAX_REJECTED_PROMPT_RATE,
        description="Load + route: max share of prompt rows read that the loader rejects (bad JSON, unknown role, "
        "over a limit); over it the stage fails, naming the count of each kind of reject, before any generation",
    )
    max_bad_row_rate: Rate = Field(
        DEFAULT_MAX_BAD_ROW_RATE, description="Gate: max share of rows that could not be validated at all."
    )
    max_missing_usage_rate: Rate = Field(
        DEFAULT_MAX_MISSING_USAGE_RATE, description="Gate: max share of overflow rows without billed usage."
    )
    allow_unvalidated_overflow: bool = Field(
        False, description="Pass overflow rows when no local sample could validate the format."
    )
    max_identity_mismatch_rate: Rate = Field(
        DEFAULT_MAX_IDENTITY_MISMATCH_RATE,
        description="Gate: max share of answers whose model or provider is not the pinned one (default 0: any fails).",
    )
    policy_shift_nats: float = Field(
        DEFAULT_POLICY_SHIFT_NATS,
        gt=0.0,
        description="Gate: the shift in mean log-probability per token under the target (overflow text vs local, per "
        "sample) that matters; the policy check fails a shift beyond half of it (its tolerance) when significant, and "
        "states whether it could see this one with policy_power",
    )
    policy_false_alarm_rate: float = Field(
        DEFAULT_POLICY_FALSE_ALARM_RATE,
        gt=0.0,
        lt=0.5,
        description="Gate: the policy check's false-alarm rate: the most often it fails a dataset whose overflow "
        "text is within the tolerance (an honest provider), split over its tests",
    )
    policy_power: float = Field(
        DEFAULT_POLICY_POWER,
        gt=0.5,
        lt=1.0,
        description="the power at which the policy check states its minimum detectable shift and sizes its samples",
    )

    def rates(self) -> dict[str, float]:
        """The numeric thresholds (what the run report shows next to each rate)."""
        return {k: v for k, v in self.model_dump().items() if not isinstance(v, bool)}


class PolicyConfig(_Model):
    """The policy check (eagle3_data.stages.policy): the local engine scores, per dataset, a pilot of
    sampled overflow and local answers, then as many as the dataset's `validation.policy_shift_nats`
    needs at `policy_power` given the pilot's spread, and the calibration pairs; the decision's
    settings are `validation`'s."""

    pilot_samples: int = Field(
        32,
        ge=2,
        description="sampled answers scored per side first, to measure the spread of "
        "their mean log-probabilities; the sample size is then chosen from it",
    )
    max_samples: int = Field(
        4096,
        ge=0,
        description="at most this many sampled answers per side, and this many calibration pairs; 0: no policy check",
    )
    seed: int = Field(0, ge=0, description="which samples (a hash of seed and sample id)")
    in_flight_per_endpoint: int = Field(8, ge=1, le=1024, description="scoring requests in flight per local endpoint")
    top_logprobs: int = Field(
        20,
        ge=1,
        le=163_840,
        description="the likeliest ids whose log-probabilities each scoring request asks for at every position "
        "(the nucleus test's view of the target's distribution: a token outside a nucleus wider than this is "
        "not seen); a vLLM scoring server must allow it (--max-logprobs, default 20)",
    )
    nucleus_logit_margin: float = Field(
        0.15,
        gt=0.0,
        le=5.0,
        description="how far the generating engines' logits (the provider's, the local engine's) and the scoring "
        "engine's may differ, doubled: a token counts as outside the nucleus only beyond it (0.15: one bf16 rounding "
        "of a logit of ~30; every engine in fp32: 1e-3)",
    )
    greedy_max_gap: float = Field(
        1.0,
        gt=0.0,
        description="the greedy test counts a calibration answer's token as off the target's argmax when the "
        "argmax's log-probability exceeds its own by more than nucleus_logit_margin and at most this (nats): other "
        "weights reorder near-ties, while a re-split token (alike on both paths) mostly lies far below",
    )


class MergeConfig(_Model):
    max_length: int = Field(
        8192,
        ge=16,
        le=1_048_576,
        description="Max tokens per training sample (prompt + output); longer ones follow merge.length_policy.",
    )
    length_policy: LengthPolicy = Field("truncate", description="what happens to samples over max_length")
    shard_tokens: int = Field(1_000_000, ge=1, description="tokens per merged shard")
    seed: int = Field(0, ge=0, description="shuffle seed")
    draft_vocab_size: int = Field(
        32_000,
        ge=1,
        description="the drafter's vocabulary: the most trained target tokens, written beside the shards "
        "for speculators and SpecForge (capped at the target's vocabulary)",
    )


class HiddenStatesConfig(_Model):
    convention: LayerConvention = Field(
        "output",
        description="Aux hidden-state layers: output (output of layers 1, L/2-1, L-4: SpecForge) or "
        "input (input to layers 2, L/2, L-3 + last: vLLM/speculators).",
    )
    layer_ids: tuple[int, ...] | None = Field(
        None, strict=False, description="aux layer ids in the convention's numbering; empty: EAGLE-3's defaults for it"
    )
    last_hidden: bool = Field(True, description="also store the last layer's hidden state (every trainer needs it)")
    last_hidden_norm: Literal["pre", "post"] = Field(
        "pre",
        description="the last state before the final norm (speculators; export-specforge applies the norm, "
        "recorded with the shards) or after it (SpecForge's own convention)",
    )
    batch_tokens: int = Field(8192, ge=1, description="tokens per forward batch")
    fp8: bool = Field(False, description="store the aux states as fp8 e4m3 with a per-token scale (half the bytes)")
    storage_dtype: StorageDtype = Field(
        "bf16", description="dtype of the stored states whatever the forward ran in (compute: keep the forward's)"
    )
    shard_tokens: int = Field(65_536, ge=1, description="tokens per hidden-state file")
    logprobs: bool = Field(
        True,
        description="store every token's log-probability under the target (the final norm and LM head over "
        "the last state: ~3.5% of a Kimi-K2.5 forward, 4 bytes per token); what proves the extraction against the "
        "engine's own log-probabilities and scores every row for the policy check",
    )
    backend: HiddenStatesBackend = Field("transformers", description="extraction backend")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per extraction worker (vllm backend)")
    max_images: int = Field(
        0,
        ge=0,
        description="images per sample the extraction backend is started for (a vision-language target: "
        "Kimi-K2.5); image samples are extracted with their pixels, never over their ids alone: with 0 (or a "
        "text-only target) they are left out of extraction, counted and named in the manifest",
    )
    workers: int = Field(
        1,
        ge=1,
        description="GPU extraction workers: one task each that loads the model once and extracts its "
        "share of the merged shards (balanced by tokens), skipping shards an earlier attempt committed",
    )


class ExportConfig(_Model):
    """The trainers' exports (`export-speculators`, `export-specforge`, the probe's): each checks itself
    through its trainer's own reader before it reports success (exports/check.py)."""

    check_samples: int = Field(
        8,
        ge=0,
        description="rows of every export checked through its trainer's reader (each state against the "
        "log-probability the extraction recorded for its token); 0: no check (the CLI's --no-check)",
    )


class ProbeConfig(_Model):
    """The drafter's verdict after extraction (eagle3_data.stages.probe.drafter): a small EAGLE-3 head trained with
    speculators on a fixed split of the run's export, scored on the held-out rows. On by default
    where it finishes within `budget_s`: on a GPU worker its defaults take ~5 min at Kimi-K2.5's
    width (measured on an H200, docs/hidden_states.md, "The drafter's verdict"); on a CPU they pace
    past the budget even on the tiny target (speculators pads every step to `max_len`;
    benchmarks/gpu_probe.py --hidden 64), so `auto` skips it there, saying so. Whatever
    `when` says, its first steps' pace is projected over the rest and a probe that would overrun
    the budget stops there instead of spending it. What it tells apart: benchmarks/probe_faults.py."""

    when: Literal["auto", "always", "never"] = Field(
        "auto",
        description="run the probe after extraction (the DAG's probe task): auto where the worker has a "
        "GPU (a CPU one skips it: its defaults pace past budget_s there), always, or never",
    )
    samples: int = Field(256, ge=1, description="train samples at most (the rest of the extraction is not read)")
    eval_samples: int = Field(64, ge=1, description="held-out samples at most (never more than a fifth of the export)")
    steps: int = Field(200, ge=1, description="optimizer steps")
    draft_length: int = Field(
        3, ge=1, le=16, description="draft tokens per step: acc_0..acc_{k-1} (speculators' ttt_steps)"
    )
    batch_size: int = Field(4, ge=1, description="samples packed per step")
    max_len: int = Field(4096, ge=16, description="packed tokens per step at most (longer samples are cut)")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate")
    eval_every: int = Field(25, ge=1, description="steps between held-out evaluations (the learning curve)")
    seed: int = Field(0, ge=0, description="the split, the init and the sample order")
    seeds: int = Field(
        2,
        ge=1,
        description="drafters trained, seeds seed..seed+seeds-1 (the same split, another init and sample order): "
        "the simulated acceptance's spread on the run's own data, the verdict's noise",
    )
    min_simulated_acceptance: float | None = Field(
        None,
        ge=0,
        description="the data-quality floor of the probe's verdict: the seeds' mean simulated acceptance above it by "
        "more than their spread passes, below it by more fails, within it is inconclusive; null: not judged",
    )
    budget_s: float = Field(
        1800.0,
        gt=0,
        description="the probe's time: one whose first steps project past it stops there (auto: skipped, "
        "always: the task fails), and the task is stopped at it",
    )


class PlanConfig(_Model):
    """What the plan (`eagle3-data plan`, the DAG's `dry_run`) cannot measure before a run: the
    answers' expected length, the real target's width when the model here is a stand-in, and the
    extraction's prefill rate. Each figure the plan derives from these is labelled with its source."""

    expected_output_tokens: int | None = Field(
        None,
        ge=1,
        description="expected answer length in tokens (the expected USD, storage and GPU hours); empty: half of "
        "generation.sampling.max_new_tokens, labelled an assumption. An earlier run of the dataset against a "
        "real (not stand-in) engine wins: its mean completion tokens",
    )
    target_hidden_size: int = Field(
        7168,
        ge=1,
        description="the real target's hidden size, for the storage figures when model.source is a stand-in "
        "(or its config.json is not readable here); 7168: Kimi-K2.5's text_config.hidden_size",
    )
    prefill_tokens_per_s_per_gpu: float = Field(
        4000.0,
        gt=0,
        description="extraction rate per GPU (a prefill) for the GPU-hour figure; 4,000: DeepSeek's published "
        "73.7k input tokens/s per 8-GPU H800 node for DeepSeek-V3/R1 (Kimi-K2.5's architecture) with 56.3% "
        "prefix-cache hits, i.e. ~4.0k computed tokens/s per GPU; extraction runs without a prefix cache. "
        "Unmeasured here on the real checkpoint: set your own (benchmarks/gpu_extract.sh)",
    )


class LimitsConfig(_Model):
    max_message_bytes: int = Field(1_000_000, ge=1, description="largest accepted prompt row (bytes of its messages)")
    max_image_bytes: int = Field(
        20_000_000, ge=1, description="largest accepted image of an image prompt (bytes, encoded)"
    )
    max_prompt_tokens: int | None = Field(None, ge=1, description="longest accepted prompt; empty: the model's context")


class TimeoutsConfig(_Model):
    """Airflow's `execution_timeout` of each task: a task that hangs (a stuck engine, a dead
    socket) is killed and retried, and the retry resumes from the stage's checkpoints. Generation
    is sized per run from its samples and the measured rates (docs/dag.md, "Timeouts")."""

    audit_tokenizer_s: float = Field(1800.0, gt=0, description="audit_tokenizer (tokenizer load + checks)")
    load_route_s: float = Field(3600.0, gt=0, description="load_route (reads, renders and routes every prompt)")
    generation_floor_s: float = Field(1800.0, gt=0, description="generation tasks: never less than this")
    generation_cap_s: float = Field(172_800.0, gt=0, description="generation tasks: never more than this (48 h)")
    generation_margin: float = Field(
        3.0, ge=1.0, description="generation tasks: this many times the time its samples take at the measured rate"
    )
    reconstruct_s: float = Field(7200.0, gt=0, description="reconstruct")
    score_policy_s: float = Field(3600.0, gt=0, description="score_policy (the policy check's scoring requests)")
    validate_s: float = Field(7200.0, gt=0, description="validate")
    merge_s: float = Field(7200.0, gt=0, description="merge")
    plan_hidden_states_s: float = Field(1800.0, gt=0, description="plan_hidden_states (and discarding stale states)")
    extract_hidden_states_s: float = Field(172_800.0, gt=0, description="each hidden-state extraction worker")
    commit_hidden_states_s: float = Field(1800.0, gt=0, description="commit_hidden_states")
    publish_s: float = Field(1800.0, gt=0, description="publish")


class DevConfig(_Model):
    bpe_split_rate: Rate = Field(0.0, description="dev inference server only: share of outputs sampled with split BPE")


class DatasetConfig(_Model):
    name: str = Field(pattern=NAME_RE.pattern, description="dataset name (S3 path segment)")
    prompts: str | None = Field(
        None,
        description="root (s3:// or local) holding {name}/date=YYYY-MM-DD/*.jsonl|parquet, or a file; "
        "default prompts_root",
    )
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig,
        description="the global thresholds with this dataset's overrides applied",
    )
    dev: DevConfig = Field(default_factory=DevConfig)

    @property
    def dev_bpe_split_rate(self) -> float:
        return self.dev.bpe_split_rate


class PipelineConfig(_Model):
    storage: StorageConfig
    schedule: str | None = Field("@daily", description="cron, preset, or null for manual runs only")
    prompts_root: str | None = Field(None, description="default s3://{bucket}/{prefix}/prompts")
    tokenizer: TokenizerConfig
    model: ModelConfig
    generation: GenerationConfig
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    merge: MergeConfig = Field(default_factory=MergeConfig)
    hidden_states: HiddenStatesConfig = Field(default_factory=HiddenStatesConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    plan: PlanConfig = Field(default_factory=PlanConfig)
    stand_ins: tuple[StandIn, ...] = Field(
        (),
        strict=False,
        description="what this (dev) config runs on instead of the real thing: tokenizer and model "
        "(dev: builds), local_engine and overflow_provider (the dev inference server). A dev: source is refused "
        "unless listed here; every manifest, the run report and the Asset event of its runs name them",
    )
    datasets: tuple[DatasetConfig, ...] = Field(strict=False, min_length=1)
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @property
    def raw(self) -> dict[str, Any]:
        """The mapping this config was validated from (a copy): overrides merge into it."""
        return copy.deepcopy(self._raw)

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise UserError(f"datasets: no dataset named {name!r} (configured: {', '.join(self.dataset_names)})")

    def with_overrides(self, overrides: dict[str, Any], *, where: str = "config") -> PipelineConfig:
        """A new config with `overrides` deep-merged into the file's values, validated again
        (an unknown key in `overrides` is refused like one in the file)."""
        raw = self.raw
        deep_merge(raw, overrides)
        return parse_config(raw, where=where)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# -- loading -----------------------------------------------------------------------------------
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent / "defaults" / "pipeline.yaml"  # package data
# The packaged dev configs by their target's family (`model.family`): a run picks one with the
# trigger param `config` (or `--config` on the CLI); a production config is $EAGLE3_CONFIG.
PACKAGED_CONFIGS: dict[str, Path] = {
    "kimi_k2": DEFAULT_CONFIG_PATH,
    "qwen3": DEFAULT_CONFIG_PATH.with_name("qwen3.yaml"),
}


def default_config_raw() -> dict[str, Any]:
    """The packaged default config as a plain mapping, to copy and modify (e.g. the dev stack)."""
    import yaml

    raw: dict[str, Any] = yaml.safe_load(DEFAULT_CONFIG_PATH.read_text(encoding="utf-8"))
    return raw


def config_path(path: str | os.PathLike[str] | None = None) -> Path:
    """Which file `load_config(path)` reads: `path`, else $EAGLE3_CONFIG, else the packaged default."""
    return Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)


def load_config(path: str | os.PathLike[str] | None = None) -> PipelineConfig:
    """Read and validate the config: `path`, else $EAGLE3_CONFIG, else the packaged default.

    Relative local paths in the file (tokenizer.source, model.source) resolve against the
    file's own directory, so the config works from any working directory.
    """
    import yaml

    p = config_path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UserError(f"config file {p} does not exist") from None
    except yaml.YAMLError as exc:
        raise UserError(f"config file {p} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise UserError(f"config file {p}: expected a mapping at the top level")
    for key in ("tokenizer", "model"):
        section = raw.get(key)
        if isinstance(section, dict) and isinstance(section.get("source"), str):
            section["source"] = _resolve_local(section["source"], p.parent)
    return parse_config(raw)


def resolve_source(source: str) -> str:
    """A tokenizer/model source as a loader takes it: `dev:NAME` becomes the cached dev build's
    directory (built on first use); paths and s3:// prefixes are returned unchanged. Manifests
    record the unresolved source, so they do not depend on where a cache lives."""
    if source.startswith(DEV_SOURCE_SCHEME):
        from eagle3_data.builds.sources import resolve_dev_source

        return str(resolve_dev_source(source[len(DEV_SOURCE_SCHEME) :]))
    return source


def _resolve_local(source: str, base: Path) -> str:
    source = os.path.expandvars(source)
    if "://" in source or source.startswith(DEV_SOURCE_SCHEME) or Path(source).is_absolute():
        return source
    return str((base / source).resolve())


def deep_merge(into: dict[str, Any], overrides: dict[str, Any]) -> None:
    """Merge `overrides` into `into` in place: mappings recursively, anything else replaced."""
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            deep_merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def parse_config(raw: dict[str, Any], *, where: str = "config") -> PipelineConfig:
    """Validate a raw mapping; every problem is one line `{where} {dotted.path}: {what}`."""
    try:
        cfg = PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError("\n".join(dict.fromkeys(_error_lines(exc, PipelineConfig, where)))) from None
    problems = []
    for key, kind in (("tokenizer", "tokenizer"), ("model", "model")):
        source = getattr(cfg, key).source
        if source.startswith(DEV_SOURCE_SCHEME) and kind not in cfg.stand_ins:
            problems.append(
                f"{where} {key}.source: {source} is a dev build, a stand-in: list {kind!r} in stand_ins "
                f"(this is a dev config), or name the real {key}"
            )
    seen: set[str] = set()
    for i, d in enumerate(cfg.datasets):
        if d.name in seen:
            problems.append(f"{where} datasets[{i}].name: {d.name!r} is listed twice")
        seen.add(d.name)
    if problems:
        raise UserError("\n".join(problems))
    cfg = _inherit(cfg, raw)
    cfg._raw = copy.deepcopy(raw)
    return cfg


def _inherit(cfg: PipelineConfig, raw: dict[str, Any]) -> PipelineConfig:
    """Fill what datasets inherit: the global thresholds under the keys a dataset did not set,
    and the prompts root."""
    root = (cfg.prompts_root or f"s3://{cfg.storage.bucket}/{cfg.storage.prefix}/prompts").rstrip("/")
    datasets = []
    for d in cfg.datasets:
        own = d.validation.model_dump(include=d.validation.model_fields_set)
        datasets.append(
            d.model_copy(
                update={
                    "prompts": d.prompts or root,
                    "validation": cfg.validation.model_copy(update=own),
                }
            )
        )
    return cfg.model_copy(update={"datasets": tuple(datasets), "prompts_root": root})


# -- error lines -------------------------------------------------------------------------------
def dotted(loc: tuple[Any, ...]) -> str:
    """('datasets', 3, 'name') -> 'datasets[3].name'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _error_lines(exc: ValidationError, model: type[BaseModel], where: str) -> list[str]:
    lines = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"{where} {dotted(loc)}: {unknown_key_message(str(loc[-1]), _keys_at(model, loc[:-1]))}")
        elif err["type"] == "missing":
            lines.append(f"{where} {dotted(loc)}: required")
        else:
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            msg = err["msg"].removeprefix("Value error, ").replace("a valid tuple", "a list")
            lines.append(f"{where} {dotted(loc)}: {msg} (got {got})")
    return lines


def unknown_key_message(key: str, valid: list[str], what: str = "key") -> str:
    """'unknown key (did you mean X?)', naming the nearest valid key, or listing them."""
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"unknown {what} (did you mean {close[0]}?)"
    return f"unknown {what} (valid: {', '.join(valid)})" if valid else f"unknown {what}"


def _keys_at(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model found by following `loc` from `model` ([] when not a model)."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(part, int):
            args = [a for a in get_args(tp) if a is not Ellipsis]
            tp = args[0] if args else None
        elif isinstance(tp, type) and issubclass(tp, BaseModel) and part in tp.model_fields:
            tp = tp.model_fields[part].annotation
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _unwrap(tp: Any) -> Any:
    """Optional[X] / Annotated[X, ...] -> X."""
    while True:
        origin = typing.get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


# -- trigger params (the DAG's form: plugins/eagle3_airflow.py builds it) ---------------------
# Trigger param -> the config field it overrides (`runs.run.resolve_run` applies them). The form
# takes bounds, enums and descriptions from that field; thresholds are nullable (empty keeps the
# config's per-dataset values).
CONFIG_PARAMS: dict[str, str] = {
    "overflow_strategy": "routing.strategy",
    "overflow_fraction": "routing.overflow_fraction",
    "max_usd": "generation.overflow.max_usd",
    "regenerate": "generation.regenerate",
    "history": "generation.history",
    "max_bpe_mismatch_rate": "validation.max_bpe_mismatch_rate",
    "max_billing_deviation": "validation.max_billing_deviation",
    "max_length": "merge.max_length",
    "layer_convention": "hidden_states.convention",
    "hidden_states_backend": "hidden_states.backend",
    "last_hidden_norm": "hidden_states.last_hidden_norm",
    "hidden_states_fp8": "hidden_states.fp8",
    "hidden_states_storage_dtype": "hidden_states.storage_dtype",
    "probe": "probe.when",
    "probe_samples": "probe.samples",
    "probe_steps": "probe.steps",
    "probe_draft_length": "probe.draft_length",
}
THRESHOLD_PARAMS = ("max_bpe_mismatch_rate", "max_billing_deviation")
# Every trigger param a run takes, in the form's order: the config's, and those `resolve_run`
# reads itself (which datasets, the run key, the stages to replace, how far to go).
TRIGGER_PARAMS: tuple[str, ...] = (
    "datasets",
    "run_name",
    "config",
    *CONFIG_PARAMS,
    "fresh_stages",
    "skip_hidden_states",
    "dry_run",
)


def config_field(dotted_path: str) -> Any:
    """The pydantic FieldInfo of a dotted config path, e.g. 'routing.overflow_fraction'."""
    model: Any = PipelineConfig
    *parents, name = dotted_path.split(".")
    for part in parents:
        model = _unwrap(model.model_fields[part].annotation)
    return model.model_fields[name]


def config_value(config: PipelineConfig, dotted_path: str) -> Any:
    value: Any = config
    for part in dotted_path.split("."):
        value = getattr(value, part)
    return value


def config_field_schema(dotted_path: str, *, nullable: bool = False) -> dict[str, Any]:
    """JSON schema of one config field (type, enum, bounds), as Airflow's Param takes it;
    `nullable`: null allowed too."""
    from pydantic import TypeAdapter

    info = config_field(dotted_path)
    base = _unwrap(info.annotation)
    schema = TypeAdapter(Annotated[base, *info.metadata] if info.metadata else base).json_schema()
    schema.pop("title", None)
    if nullable:
        schema["type"] = [schema["type"], "null"] if isinstance(schema.get("type"), str) else ["null"]
        if "enum" in schema:
            schema["enum"] = [*schema["enum"], None]
    return schema


def check_run_params(params: dict[str, Any]) -> None:
    """Refuse trigger conf keys that are not params (a mistyped name must not be ignored);
    every unknown key is one line naming it and the nearest param."""
    bad = [k for k in params if k not in TRIGGER_PARAMS]
    if bad:
        raise UserError("\n".join(f"params.{k}: {unknown_key_message(k, list(TRIGGER_PARAMS), 'param')}" for k in bad))
