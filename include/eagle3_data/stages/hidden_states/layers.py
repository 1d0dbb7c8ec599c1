"""Which tensors the EAGLE-3 aux layers are, under the two conventions in use.

The same three tensors have two names: SpecForge, Model-Optimizer and TorchSpec say "output of
layer i" with ids `[1, L//2-1, L-4]`; speculators/vLLM and the original EAGLE-3 say "input to
layer i" with `[2, L//2, L-3]`. A `transformers` forward with `output_hidden_states=True`
returns L+1 tensors where `hidden_states[k]` is the input to layer k (k = 0 is the embedding
output) and the last one is the *final-norm* output, so: output of layer i = hidden_states[i+1],
input to layer i = hidden_states[i]. Everything else in the package works in that index space.
"""

from __future__ import annotations

from eagle3_data.errors import UserError

CONVENTIONS = ("output", "input")


def default_layer_ids(num_layers: int, convention: str) -> list[int]:
    """EAGLE-3's low/mid/high aux layers for a model of `num_layers` decoder layers."""
    check_convention(convention)
    if num_layers < 4:
        raise UserError(f"model has {num_layers} layers: EAGLE-3 aux layers need at least 4")
    if convention == "output":
        return [1, num_layers // 2 - 1, num_layers - 4]
    return [2, num_layers // 2, num_layers - 3]


def hidden_state_indices(layer_ids: list[int], convention: str, num_layers: int) -> list[int]:
    """Indices into a transformers `hidden_states` tuple for these layer ids.

    Refuses ids whose tensor `hidden_states` does not hold un-normalised: the output of the
    last layer only exists there after the final norm (ask for `last_hidden` instead).
    """
    check_convention(convention)
    offset = 1 if convention == "output" else 0
    top = num_layers - 2 if convention == "output" else num_layers - 1
    bad = [i for i in layer_ids if not 0 <= i <= top]
    if bad:
        raise UserError(
            f"layer ids {bad} out of range for convention {convention!r} on a {num_layers}-layer model "
            f"(valid 0..{top}; the final layer's output is the last state: --last-hidden)"
        )
    return [i + offset for i in layer_ids]


def check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise UserError(f"convention {convention!r}: expected one of {', '.join(CONVENTIONS)}")
