"""Run in the speculators venv (never imported by the library): the probe's training and evaluation
with speculators' own EAGLE-3 draft model, its collation (with its EAGLE-3 `shift_batch`), its KL
loss and its per-position metrics (`full_acc_k`, `cond_acc_k`, models/eagle3/metrics.py).

speculators' `Trainer` takes `torch.accelerator.current_accelerator()` and falls back to "cuda"
without one, so the loop here is its step alone: the model's forward (which returns the loss and
the metrics' sums), backward, AdamW. Every arm of the spec is one drafter, trained from scratch on
its rows of a train export and evaluated on its rows of an eval export, all in this one process so
the imports (seconds) are paid once.

argv: a JSON spec {"verifier": model dir, "device": "cpu"|"cuda", "budget_s": seconds or null,
"deadline": the budget's end (epoch seconds, set by the caller as it starts this process) or null,
"arms": [{"name", "train", "eval", "train_rows", "eval_rows", "vocab_dir", "draft_vocab", "steps",
"draft_length", "seed", "batch_size", "max_len", "lr", "eval_every"}]}. Prints one JSON line per
arm: the loss per step, the metrics' sums at each evaluation (the learning curve) and the seconds
taken; or, when the first arm's first steps project past the budget, one line {"over_budget": ...}
and exit status 3 (`Budget`).
"""

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig, shift_batch
from speculators.proposals.greedy import GreedyTokenProposalConfig
from speculators.train.data import ArrowDataset, CollateFn
from transformers import AutoConfig, LlamaConfig

OVER_BUDGET_EXIT = 3  # eagle3_data.stages.probe.drafter.OVER_BUDGET_EXIT
TIMED_STEPS = 3  # steps timed after the first (which pays the lazy set-up) to project the rest


class Budget:
    """The probe's time guard: after the first arm's first 1 + TIMED_STEPS steps, the measured pace
    (seconds a training step, seconds an evaluation) is projected over every step and evaluation
    still to come, in every arm; past the deadline (its caller's clock at this process's start plus
    `budget_s`: the imports count) the probe stops there (`over_budget`), instead of spending the
    budget to be killed at its end."""

    def __init__(self, spec: dict[str, Any]):
        self.budget_s, self.deadline = spec.get("budget_s"), spec.get("deadline")
        self.arms = spec["arms"]
        self.checked = self.deadline is None

    @staticmethod
    def evaluations(arm: dict[str, Any], after_step: int) -> int:
        """The arm's evaluations after `after_step` (every eval_every steps and at its last)."""
        at = set(range(arm["eval_every"], arm["steps"] + 1, arm["eval_every"])) | {arm["steps"]}
        return sum(1 for step in at if step > after_step)

    def check(self, arm_index: int, done: int, step_seconds: list[float], eval_s: float) -> None:
        if self.checked or done < 1 + TIMED_STEPS or arm_index > 0:
            return
        self.checked = True
        step_s = sum(step_seconds[1:]) / (len(step_seconds) - 1)
        arm = self.arms[0]
        # checked after step `done`'s update, before its evaluation (if it has one): that one is still to come
        left = (arm["steps"] - done) * step_s + self.evaluations(arm, done - 1) * eval_s
        for later in self.arms[1:]:  # each pays its step-0 evaluation too
            left += later["steps"] * step_s + (1 + self.evaluations(later, 0)) * eval_s
        if time.time() + left > self.deadline:
            over = {
                "projected_s": self.budget_s - (self.deadline - time.time()) + left,
                "budget_s": self.budget_s,
                "steps": sum(a["steps"] for a in self.arms),
                "drafters": len(self.arms),
                "step_s": step_s,
                "eval_s": eval_s,
                "timed_steps": len(step_seconds) - 1,
            }
            print(json.dumps({"over_budget": over}), flush=True)
            sys.exit(OVER_BUDGET_EXIT)


def drafter(verifier: str, target, arm: dict[str, Any], aux_layers: list[int]) -> Eagle3DraftModel:
    """A one-layer llama drafter of the target's width (speculators' EAGLE-3 for DeepSeek-family
    targets), its embeddings, LM head and verifier norm the target's."""
    heads = 4 if target.hidden_size < 512 else target.hidden_size // 128
    layer = LlamaConfig(
        hidden_size=target.hidden_size,
        intermediate_size=2 * target.hidden_size,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=target.hidden_size // heads,
        vocab_size=target.vocab_size,
        rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=8192,
    )
    layer._attn_implementation = "eager"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=arm["draft_vocab"],
        norm_before_residual=True,
        eagle_aux_hidden_state_layer_ids=aux_layers,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=arm["draft_length"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(verifier),
        ),
    )
    model = Eagle3DraftModel(config=config)
    vocab = Path(arm["vocab_dir"])
    n = arm["draft_vocab"]
    t2d = np.load(vocab / f"t2d-{n}.npy")  # one entry per target LM-head row (merge_datasets' vocab_size)
    model.load_vocab_mappings(torch.from_numpy(t2d), torch.from_numpy(np.load(vocab / f"d2t-{n}.npy")))
    model.load_verifier_weights()
    return model


def loader(export: str, rows: list[int], arm: dict[str, Any], target, seed: int | None):
    """speculators' reader and collation over `rows` of an export; shuffled when seeded."""
    data = torch.utils.data.Subset(ArrowDataset(max_len=arm["max_len"], datapath=export, on_missing="raise"), rows)
    collate = CollateFn(
        arm["max_len"], target.hidden_size, num_target_layers=3, dtype=torch.float32, preprocess=shift_batch
    )
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.utils.data.DataLoader(
        data, batch_size=arm["batch_size"], shuffle=seed is not None, collate_fn=collate, generator=generator
    )


def tensors(batch: dict[str, Any], device: str) -> dict[str, Any]:
    return {k: v.to(device) for k, v in batch.items() if isinstance(v, torch.Tensor)}


def autocast(device: str):
    """bf16 autocast on a GPU (tensor-core rate: the cost docs/hidden_states.md estimates), fp32 on CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")


def first_drafts(loss_mask: torch.Tensor) -> torch.Tensor:
    """The positions of each answer's first draft: where the (shifted) loss mask turns on. After
    speculators' `shift_batch` position t pairs token t+1 with state t, so the first is the last
    prompt position: the draft right after prefill, the one a loss mask one position late never
    trains (SpecForge#885)."""
    mask = loss_mask.bool()
    before = torch.cat([torch.zeros_like(mask[:, :1]), mask[:, :-1]], dim=1)
    return mask & ~before


@torch.no_grad()
def evaluate(model, batches, arm: dict[str, Any], loss_config, device: str) -> dict[str, Any]:
    """The metrics' sums over the eval rows (speculators' full and conditional accuracy per step),
    the held-out loss (the mean of speculators' loss over the eval batches: the same batches for
    every arm scored on the same rows), and the same for each answer's first draft alone (one draft
    step from the positions of `first_drafts`)."""
    model.eval()
    sums: dict[str, float] = {}
    losses, first_losses, first_hits, first_total = [], [], 0.0, 0.0
    for batch in batches:
        inputs = tensors(batch, device)
        with autocast(device):
            _, loss, metrics = model(**inputs, ttt_steps=arm["draft_length"], loss_config=loss_config)
            inputs["loss_mask"] = first_drafts(inputs["loss_mask"])
            _, first_loss, first = model(**inputs, ttt_steps=1, loss_config=loss_config)
        losses.append(float(loss))
        if inputs["loss_mask"].any():  # a batch of rows without answers has no first draft
            first_losses.append(float(first_loss))
            first_hits += float(first["full_acc_0_sum"])
            first_total += float(first["full_acc_0_total"])
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    model.train()
    k = arm["draft_length"]
    return {
        "loss": float(np.mean(losses)),
        "full_acc_sum": [sums[f"full_acc_{i}_sum"] for i in range(k)],
        "full_acc_total": [sums[f"full_acc_{i}_total"] for i in range(k)],
        "cond_acc_sum": [sums[f"cond_acc_{i}_sum"] for i in range(k)],
        "cond_acc_total": [sums[f"cond_acc_{i}_total"] for i in range(k)],
        "first_loss": float(np.mean(first_losses)) if first_losses else 0.0,
        "first_hits": first_hits,
        "first_total": first_total,
    }


def train_arm(
    spec: dict[str, Any], arm: dict[str, Any], budget: Budget | None = None, index: int = 0
) -> tuple[Eagle3DraftModel, dict[str, Any]]:
    """One arm trained: the drafter (for checks that score it by hand, tests/trainers/probe_oracle.py)
    and its figures: the loss per step, the metrics' sums per evaluation, the seconds taken. The
    `budget` is checked once its first steps are timed."""
    started = time.monotonic()
    device = spec.get("device", "cpu")
    torch.manual_seed(arm["seed"])
    # the language model's config: Kimi-K2.5's (a vision-language checkpoint) is its text_config
    target = AutoConfig.from_pretrained(spec["verifier"]).get_text_config()
    info = json.loads((Path(arm["train"]) / "export_info.json").read_text())
    model = drafter(spec["verifier"], target, arm, info["hidden_states"]["aux_layer_ids_vllm"]).to(device)
    model.train()
    train = loader(arm["train"], arm["train_rows"], arm, target, arm["seed"])
    held_out = list(loader(arm["eval"], arm["eval_rows"], arm, target, None))  # read once, evaluated often
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=arm["lr"])
    loss_config = resolve_loss_config("kl_div", "eager")  # the trainer's default loss (the fused one needs Triton)
    losses: list[float] = []
    evaluated = time.monotonic()
    curve = [{"step": 0, **evaluate(model, held_out, arm, loss_config, device)}]
    eval_s = time.monotonic() - evaluated
    step_seconds: list[float] = []
    while len(losses) < arm["steps"]:
        for batch in train:
            stepped = time.monotonic()
            with autocast(device):
                _, loss, _ = model(**tensors(batch, device), ttt_steps=arm["draft_length"], loss_config=loss_config)
            optim.zero_grad()
            loss.backward()
            optim.step()
            losses.append(float(loss.detach()))
            step_seconds.append(time.monotonic() - stepped)
            if budget is not None:
                budget.check(index, len(losses), step_seconds, eval_s)
            if len(losses) % arm["eval_every"] == 0 or len(losses) == arm["steps"]:
                curve.append({"step": len(losses), **evaluate(model, held_out, arm, loss_config, device)})
            if len(losses) == arm["steps"]:
                break
    return model, {"name": arm["name"], "losses": losses, "curve": curve, "seconds": time.monotonic() - started}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(spec.get("threads") or torch.get_num_threads())
    budget = Budget(spec)
    for index, arm in enumerate(spec["arms"]):
        print(json.dumps(train_arm(spec, arm, budget, index)[1]), flush=True)


if __name__ == "__main__":
    main()
