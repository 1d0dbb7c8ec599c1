"""The generation stages called the way the tests describe a stage: a tokenizer and a sampling
dict that carries `thinking` (as the config's `generation.sampling` does), with the client's
options as keywords. The library takes them bound and typed (the output format, the config
section, the client's runtime settings, `StageSetup`); this is the one place that binds them for
the tests."""

from __future__ import annotations

from eagle3_data.chat_format import get_output_format
from eagle3_data.config import LocalGenerationConfig, OverflowGenerationConfig
from eagle3_data.engines import wire_for
from eagle3_data.stages.generate import local, openrouter
from eagle3_data.stages.generate.checkpoint import StageSetup
from eagle3_data.stages.generate.contracts import StageSummary

# The model the dev server serves (a request for another is a 400, as on OpenRouter).
MODEL = "moonshotai/kimi-k2.5"
SETUP = ("model", "inputs", "progress", "journal_dir", "rerun", "routes", "side_files", "turns")


def _split(options: dict) -> tuple[StageSetup, dict]:
    setup = {k: options.pop(k) for k in SETUP if k in options}
    if setup.get("inputs") is not None:
        setup["inputs"] = tuple(setup["inputs"])
    if setup.get("side_files") is None:
        setup.pop("side_files", None)
    return StageSetup(**setup), options


def _section(section, options: dict) -> dict:
    """The options the config `section` declares, taken out of `options`."""
    return {k: options.pop(k) for k in list(options) if k in section.model_fields}


def _bind(tokenizer, sampling: dict):
    sampling = dict(sampling)
    return get_output_format(tokenizer, thinking=sampling.pop("thinking")), sampling


def generate_local(
    store,
    ref,
    prompts,
    tokenizer,
    endpoints,
    sampling,
    *,
    engine: str = "sglang",
    api_key: str | None = None,
    **options,
) -> StageSummary:
    fmt, sampling = _bind(tokenizer, sampling)
    setup, options = _split(options)
    return local.generate_local(
        store,
        ref,
        prompts,
        fmt,
        endpoints,
        sampling,
        wire=wire_for(engine, api_key),
        config=LocalGenerationConfig(**_section(LocalGenerationConfig, options)),
        runtime=local.LocalRuntime(**options),
        setup=setup,
    )


def generate_vllm(store, ref, prompts, tokenizer, endpoints, sampling, **options) -> StageSummary:
    return generate_local(store, ref, prompts, tokenizer, endpoints, sampling, engine="vllm", **options)


def generate_overflow(
    store, ref, prompts, tokenizer, base_url, api_key, model, provider, max_usd, *, sampling, **options
) -> StageSummary:
    fmt, sampling = _bind(tokenizer, sampling)
    setup, options = _split(options)
    reasoning = options.pop("reasoning", None)
    section = _section(OverflowGenerationConfig, options)
    if max_usd is not None:  # None: no cap (`OverflowRuntime.capped`)
        section["max_usd"] = max_usd
    config = OverflowGenerationConfig(model=model, provider=provider or {}, **section)
    return openrouter.generate_overflow(
        store,
        ref,
        prompts,
        fmt,
        base_url,
        api_key,
        sampling,
        config=config,
        reasoning=reasoning,
        runtime=openrouter.OverflowRuntime(capped=max_usd is not None, **options),
        setup=setup,
    )


def image_prompts(store, pictures: list[list[bytes]], dataset: str = "images", route: str = "local") -> list[dict]:
    """Prompt rows (prompts-stage columns) of one user turn each: an image part per picture, then a
    question; each image stored in `store` as the prompts stage stores it (`ImageSink`), the part
    naming the object and the row carrying the references."""
    import json

    from eagle3_data.images import ImageSink

    sink = ImageSink(store, max_bytes=1 << 20)
    rows = []
    for i, datas in enumerate(pictures):
        refs = [sink._store(data) for data in datas]
        content = [{"type": "image_url", "image_url": {"url": ref["uri"]}} for ref in refs]
        content.append({"type": "text", "text": f"Question {i}: what is in the picture?"})
        rows.append(
            {
                "sample_id": f"img{i:04d}",
                "dataset": dataset,
                "sample_index": i,
                "route": route,
                "messages": json.dumps([{"role": "user", "content": content}]),
                "tools": None,
                "images": json.dumps(refs),
            }
        )
    return rows
