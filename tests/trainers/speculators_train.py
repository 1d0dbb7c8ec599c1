"""Run in .venv-speculators: speculators' EAGLE-3 draft model, its collation and its loss, trained on
CPU on an export-speculators folder with the draft vocabulary written beside it. speculators'
`Trainer` takes `torch.accelerator.current_accelerator()` and falls back to "cuda" without one
(train/trainer.py), so the loop here is the trainer's step alone: its model's forward (which
returns the loss), backward, AdamW. argv: export dir, verifier (target) model dir, steps, draft
vocab size, [a folder to save the drafter in]. Prints JSON: the loss per step."""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig, shift_batch
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import ArrowDataset, CollateFn
from transformers import AutoConfig, LlamaConfig

export, verifier, steps, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
target = AutoConfig.from_pretrained(verifier).get_text_config()  # Kimi-K2.5: its text_config
info = json.loads((export / "export_info.json").read_text())
# the drafter's own layer is a llama layer (speculators' EAGLE-3 supports llama and qwen3 layers)
# of the target's width, as speculators' configs for DeepSeek-family targets do
layer = LlamaConfig(
    hidden_size=target.hidden_size,
    intermediate_size=2 * target.hidden_size,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=target.hidden_size // 4,
    vocab_size=target.vocab_size,
    rms_norm_eps=target.rms_norm_eps,
    max_position_embeddings=4096,
)
layer._attn_implementation = "eager"
config = Eagle3SpeculatorConfig(
    transformer_layer_config=layer,
    draft_vocab_size=n,
    norm_before_residual=True,
    eagle_aux_hidden_state_layer_ids=info["hidden_states"]["aux_layer_ids_vllm"],
    speculators_config=SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
        default_proposal_method="greedy",
        verifier=VerifierConfig.from_pretrained(verifier),
    ),
)
model = Eagle3DraftModel(config=config)
d2t = torch.from_numpy(np.load(export / f"d2t-{n}.npy"))
t2d = torch.from_numpy(np.load(export / f"t2d-{n}.npy"))
model.load_vocab_mappings(t2d, d2t)
model.load_verifier_weights()  # embeddings, LM head and verifier_norm: the target's
model.train()

max_len = 256
data = ArrowDataset(max_len=max_len, datapath=str(export), on_missing="raise")
collate = CollateFn(max_len, target.hidden_size, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch)
loader = torch.utils.data.DataLoader(
    data, batch_size=4, shuffle=True, collate_fn=collate, generator=torch.Generator().manual_seed(0)
)
optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
# the trainer's default KL loss to the target's distribution, in its eager form (the fused one needs Triton)
loss_config = resolve_loss_config("kl_div", "eager")
losses: list[float] = []
while len(losses) < steps:
    for batch in loader:
        batch = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
        _, loss, _metrics = model(**batch, ttt_steps=3, loss_config=loss_config)
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(float(loss.detach()))
        if len(losses) == steps:
            break
if len(sys.argv) > 5:  # a folder to save the trained drafter in speculators' format (vLLM serves that)
    model.save_pretrained(sys.argv[5])
print(json.dumps({"losses": losses}))
