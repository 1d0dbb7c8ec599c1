"""The pipeline configuration: one YAML file, validated into frozen dataclasses.

Every knob that changes what is generated or how it is judged lives here, so a run's manifests
can record it and a rerun with the same config reproduces the same keys. Trigger-form params are
applied with `PipelineConfig.with_overrides`, which goes through the same validation as the file:
a bad value is refused with the key's dotted path, whether it came from YAML or from the UI.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from eagle3_data.errors import UserError

AWS_CONN_ID = "aws_default"
OPENROUTER_CONN_ID = "openrouter_default"
SGLANG_CONN_ID = "sglang_default"
OPENROUTER_POOL = "openrouter"
GPU_QUEUE = "gpu"
DAG_ID = "eagle3_datagen"

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parent.parent / "config" / "pipeline.yaml"
CONFIG_ENV = "EAGLE3_CONFIG"

ROUTING_STRATEGIES = ("fraction", "capacity")
LENGTH_POLICIES = ("truncate", "drop")
LAYER_CONVENTIONS = ("output", "input")
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class StorageConfig:
    bucket: str
    prefix: str


@dataclass(frozen=True)
class TokenizerConfig:
    source: str  # HF tokenizer dir (local path) or s3:// prefix holding one
    expected_special_ids: dict[str, int]  # audited by name before any spend


@dataclass(frozen=True)
class ModelConfig:
    name: str  # recorded in provenance and hidden-state metadata
    source: str  # HF model dir (local path) or s3:// prefix, for hidden-state extraction


@dataclass(frozen=True)
class SamplingConfig:
    """Part of every sample_id: changing it makes new samples, never overwrites old ones."""

    temperature: float
    top_p: float
    max_new_tokens: int
    thinking: bool


@dataclass(frozen=True)
class LocalGenerationConfig:
    in_flight_per_endpoint: int
    rows_per_part: int


@dataclass(frozen=True)
class OverflowGenerationConfig:
    model: str  # OpenRouter model slug
    provider: dict[str, Any]  # OpenRouter provider routing (order, allow_fallbacks, ...)
    concurrency: int
    max_usd: float  # hard spend cap per dataset and run
    price_usd_per_mtok: dict[str, float]  # {prompt, completion}: dry-run cost estimates only
    rows_per_part: int


@dataclass(frozen=True)
class GenerationConfig:
    sampling: SamplingConfig
    repeats: int
    local: LocalGenerationConfig
    overflow: OverflowGenerationConfig


@dataclass(frozen=True)
class RoutingConfig:
    strategy: str  # fraction | capacity
    overflow_fraction: float  # strategy=fraction: share of samples sent to OpenRouter
    local_capacity: int  # strategy=capacity: samples the local endpoints take per dataset and run
    calibration_samples: int  # generated on both paths to compare them


@dataclass(frozen=True)
class ValidationConfig:
    max_bpe_mismatch_rate: float  # local samples whose ids differ only by BPE merges (special/text diffs always fail)
    max_billing_deviation: float  # |billed - reconstructed| / billed, overflow rows


@dataclass(frozen=True)
class MergeConfig:
    max_length: int
    length_policy: str  # truncate | drop
    shard_tokens: int
    seed: int


@dataclass(frozen=True)
class HiddenStatesConfig:
    convention: str  # output ("output of layer i", SpecForge) | input ("input to layer i", vLLM)
    last_hidden: bool
    batch_tokens: int


@dataclass(frozen=True)
class DatasetConfig:
    name: str
    prompts: str  # root (s3:// or local) holding {name}/date=YYYY-MM-DD/*.jsonl|parquet, or a file (eagle3_data.prompts)
    validation: ValidationConfig  # global thresholds with this dataset's overrides applied
    dev_bpe_split_rate: float  # dev inference server only: share of outputs sampled with split BPE


@dataclass(frozen=True)
class PipelineConfig:
    storage: StorageConfig
    schedule: str | None
    tokenizer: TokenizerConfig
    model: ModelConfig
    generation: GenerationConfig
    routing: RoutingConfig
    validation: ValidationConfig
    merge: MergeConfig
    hidden_states: HiddenStatesConfig
    datasets: tuple[DatasetConfig, ...]
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def dataset_names(self) -> list[str]:
        return [d.name for d in self.datasets]

    def dataset(self, name: str) -> DatasetConfig:
        for d in self.datasets:
            if d.name == name:
                return d
        raise UserError(f"datasets: no dataset named {name!r} (configured: {', '.join(self.dataset_names)})")

    def with_overrides(self, overrides: dict[str, Any]) -> PipelineConfig:
        """A new config with `overrides` deep-merged into the file's values, validated again."""
        raw = copy.deepcopy(self.raw)
        _deep_merge(raw, overrides)
        return _parse(raw)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("raw")
        return d


def load_config(path: str | Path | None = None) -> PipelineConfig:
    """Read and validate the config: `path`, else $EAGLE3_CONFIG, else include/config/pipeline.yaml.

    Relative local paths in the file (tokenizer.source, model.source) resolve against the
    file's own directory, so the config works from any working directory.
    """
    import yaml

    p = Path(path or os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH)
    try:
        raw = yaml.safe_load(p.read_text())
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
    return _parse(raw)


def _resolve_local(source: str, base: Path) -> str:
    source = os.path.expandvars(source)
    if "://" in source or Path(source).is_absolute():
        return source
    return str((base / source).resolve())


def _deep_merge(into: dict[str, Any], overrides: dict[str, Any]) -> None:
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


class _Section:
    """Typed reads from one mapping; every error names the full dotted key."""

    def __init__(self, data: Any, path: str):
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise UserError(f"config {path}: expected a mapping, got {type(data).__name__}")
        self.data, self.path = data, path

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if name not in self.data or self.data[name] is None:
            if default is ...:
                raise UserError(f"config {self.key(name)}: required")
            return default
        value = self.data[name]
        if kind in (float, int) and isinstance(value, bool):
            raise UserError(f"config {self.key(name)}: expected a number, got {value!r}")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind):
            want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            raise UserError(f"config {self.key(name)}: expected {want}, got {value!r}")
        return value

    def number(self, name: str, kind: type, default: Any = ..., lo: float | None = None, hi: float | None = None) -> Any:
        value = self.get(name, kind, default)
        if lo is not None and value < lo or hi is not None and value > hi:
            raise UserError(f"config {self.key(name)}: {value!r} is outside [{lo}, {hi}]")
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: Any = ...) -> str:
        value = self.get(name, str, default)
        if value not in choices:
            raise UserError(f"config {self.key(name)}: {value!r} is not one of {', '.join(choices)}")
        return value

    def sub(self, name: str) -> _Section:
        return _Section(self.data.get(name), self.key(name))


def _validation(s: _Section, base: ValidationConfig | None) -> ValidationConfig:
    def rate(name: str) -> float:
        return s.number(name, float, getattr(base, name) if base else ..., 0.0, 1.0)

    return ValidationConfig(
        max_bpe_mismatch_rate=rate("max_bpe_mismatch_rate"),
        max_billing_deviation=rate("max_billing_deviation"),
    )


def _prices(s: _Section) -> dict[str, float]:
    return {k: s.number(k, float, 0.0, 0.0, None) for k in ("prompt", "completion")}


def _parse(raw: dict[str, Any]) -> PipelineConfig:
    top = _Section(raw, "")

    st = top.sub("storage")
    storage = StorageConfig(bucket=st.get("bucket", str), prefix=st.get("prefix", str, "eagle3-datagen").strip("/"))

    tk = top.sub("tokenizer")
    expected = tk.get("expected_special_ids", dict)
    for name, tid in expected.items():
        if not isinstance(name, str) or isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
            raise UserError(f"config tokenizer.expected_special_ids.{name}: expected a non-negative int id, got {tid!r}")
    if "<|im_end|>" not in expected:
        raise UserError("config tokenizer.expected_special_ids: must include <|im_end|> (the stop token)")
    tokenizer = TokenizerConfig(source=tk.get("source", str), expected_special_ids=dict(expected))

    md = top.sub("model")
    model = ModelConfig(name=md.get("name", str), source=md.get("source", str))

    gen = top.sub("generation")
    sp = gen.sub("sampling")
    loc = gen.sub("local")
    ov = gen.sub("overflow")
    generation = GenerationConfig(
        sampling=SamplingConfig(
            temperature=sp.number("temperature", float, 1.0, 0.0, 2.0),
            top_p=sp.number("top_p", float, 1.0, 0.0, 1.0),
            max_new_tokens=sp.number("max_new_tokens", int, 2048, 1, 262_144),
            thinking=sp.get("thinking", bool, True),
        ),
        repeats=gen.number("repeats", int, 1, 1, 64),
        local=LocalGenerationConfig(
            in_flight_per_endpoint=loc.number("in_flight_per_endpoint", int, 64, 1, 4096),
            rows_per_part=loc.number("rows_per_part", int, 256, 1, 1_000_000),
        ),
        overflow=OverflowGenerationConfig(
            model=ov.get("model", str),
            provider=ov.get("provider", dict, {}),
            concurrency=ov.number("concurrency", int, 16, 1, 1024),
            max_usd=ov.number("max_usd", float, 10.0, 0.0, None),
            price_usd_per_mtok=_prices(ov.sub("price_usd_per_mtok")),
            rows_per_part=ov.number("rows_per_part", int, 64, 1, 1_000_000),
        ),
    )

    rt = top.sub("routing")
    routing = RoutingConfig(
        strategy=rt.choice("strategy", ROUTING_STRATEGIES, "fraction"),
        overflow_fraction=rt.number("overflow_fraction", float, 0.0, 0.0, 1.0),
        local_capacity=rt.number("local_capacity", int, 0, 0, None),
        calibration_samples=rt.number("calibration_samples", int, 0, 0, None),
    )

    validation = _validation(top.sub("validation"), ValidationConfig(0.10, 0.01))

    mg = top.sub("merge")
    merge = MergeConfig(
        max_length=mg.number("max_length", int, 8192, 16, 1_048_576),
        length_policy=mg.choice("length_policy", LENGTH_POLICIES, "truncate"),
        shard_tokens=mg.number("shard_tokens", int, 1_000_000, 1, None),
        seed=mg.number("seed", int, 0, 0, None),
    )

    hs = top.sub("hidden_states")
    hidden_states = HiddenStatesConfig(
        convention=hs.choice("convention", LAYER_CONVENTIONS, "output"),
        last_hidden=hs.get("last_hidden", bool, False),
        batch_tokens=hs.number("batch_tokens", int, 8192, 1, None),
    )

    prompts_root = top.get("prompts_root", str, f"s3://{storage.bucket}/{storage.prefix}/prompts").rstrip("/")
    items = top.get("datasets", list)
    if not items:
        raise UserError("config datasets: at least one dataset is required")
    datasets: list[DatasetConfig] = []
    for i, item in enumerate(items):
        ds = _Section(item, f"datasets[{i}]")
        name = ds.get("name", str)
        if not NAME_RE.match(name):
            raise UserError(f"config datasets[{i}].name: {name!r} must match {NAME_RE.pattern}")
        if name in {d.name for d in datasets}:
            raise UserError(f"config datasets[{i}].name: {name!r} is listed twice")
        datasets.append(
            DatasetConfig(
                name=name,
                prompts=ds.get("prompts", str, prompts_root),
                validation=_validation(ds.sub("validation"), validation),
                dev_bpe_split_rate=ds.sub("dev").number("bpe_split_rate", float, 0.0, 0.0, 1.0),
            )
        )

    schedule = raw.get("schedule", "@daily")
    if schedule is not None and not isinstance(schedule, str):
        raise UserError(f"config schedule: expected a cron string, preset or null, got {schedule!r}")

    return PipelineConfig(
        storage=storage,
        schedule=schedule,
        tokenizer=tokenizer,
        model=model,
        generation=generation,
        routing=routing,
        validation=validation,
        merge=merge,
        hidden_states=hidden_states,
        datasets=tuple(datasets),
        raw=copy.deepcopy(raw),
    )
