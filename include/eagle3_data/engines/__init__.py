"""The local engines (SGLang, vLLM) by the name the config gives them (`generation.local.engine`):
their wire protocols (`sglang`, `vllm`) and what every caller shares (`client`).

Generation, the policy check and the route all talk to these servers: below the stages.
"""

from __future__ import annotations

from eagle3_data.engines.client import Wire
from eagle3_data.engines.sglang import SGLANG
from eagle3_data.engines.vllm import VLLM
from eagle3_data.errors import UserError

WIRES: dict[str, Wire] = {"sglang": SGLANG, "vllm": VLLM}


def wire_for(engine: str) -> Wire:
    try:
        return WIRES[engine]
    except KeyError:
        raise UserError(f"generation.local.engine {engine!r}: expected one of {', '.join(WIRES)}") from None
