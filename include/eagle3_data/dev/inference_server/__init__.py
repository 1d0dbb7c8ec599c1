"""Dev inference server: SGLang's `/generate` and OpenRouter-shaped `/v1/chat/completions`.

The only stand-in in the pipeline: it replaces the two engines that cannot run here (Kimi-K2.5 on
SGLang, Kimi-K2.5 behind OpenRouter) and speaks their wire protocols, so the real clients are
tested unchanged. Both endpoints share one generator (`DevTextModel`) driven by the prompt ids,
and the chat endpoint gets its prompt ids from the tokenizer's chat template: for the same prompt
and seed, the chat answer is exactly the text of the ids `/generate` returns (unless a content
fault is injected, which is the point of injecting it).

Which dataset a request belongs to (its non-canonical BPE rate) comes from the `X-Eagle3-Dataset`
header; `X-Eagle3-Sample-Id` keys the per-sample request counters (`GET /dev/stats`) that tests
use to prove no sample is paid twice. Real servers ignore both headers.

Its routes by job: `engine_info` (health, model and server info, model list), `generate`
(SGLang's `/generate`), `openrouter` (chat completions, providers, generation records),
`control` (the dev server's own `/dev/` routes); `auth` (SGLang's `--api-key` check), `state`
(what they share), `app` (composes them), `process` (the server as a child process).
"""

from eagle3_data.dev.inference_server.app import create_app, serve
from eagle3_data.dev.inference_server.process import DevServerProcess
from eagle3_data.dev.inference_server.state import DATASET_HEADER, SAMPLE_HEADER

__all__ = ["DATASET_HEADER", "SAMPLE_HEADER", "DevServerProcess", "create_app", "serve"]
