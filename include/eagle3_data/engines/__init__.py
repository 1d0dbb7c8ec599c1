"""The local engines (SGLang, vLLM) by the name the config gives them (`generation.local.engine`):
their wire protocols (`sglang`, `vllm`) and what every caller shares (`client`).

Generation, the policy check and the route all talk to these servers: below the stages.
"""

from __future__ import annotations

import copy

from eagle3_data.engines.client import Wire, bearer_headers
from eagle3_data.engines.sglang import SGLANG
from eagle3_data.engines.vllm import VLLM
from eagle3_data.errors import UserError

WIRES: dict[str, Wire] = {"sglang": SGLANG, "vllm": VLLM}


def wire_for(engine: str, api_key: str | None = None) -> Wire:
    """The engine's wire; with `api_key`, one whose requests carry it (`Wire.headers`): the key is
    held there only, never logged nor written (a wire has no key in its repr or manifest_extra)."""
    try:
        wire = WIRES[engine]
    except KeyError:
        raise UserError(f"generation.local.engine {engine!r}: expected one of {', '.join(WIRES)}") from None
    if not api_key:
        return wire
    keyed = copy.copy(wire)
    keyed.headers = bearer_headers(api_key)
    return keyed
