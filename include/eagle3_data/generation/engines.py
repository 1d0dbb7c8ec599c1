"""The local engines by the name the config gives them (`generation.local.engine`)."""

from __future__ import annotations

from eagle3_data.errors import UserError
from eagle3_data.generation.local import Wire
from eagle3_data.generation.sglang import SGLANG
from eagle3_data.generation.vllm import VLLM

WIRES: dict[str, Wire] = {"sglang": SGLANG, "vllm": VLLM}


def wire_for(engine: str) -> Wire:
    try:
        return WIRES[engine]
    except KeyError:
        raise UserError(f"generation.local.engine {engine!r}: expected one of {', '.join(WIRES)}") from None
