"""Run in the speculators venv by tests/trainers/test_probe.py: what the probe's acc_k measure,
checked from outside the code under test.

The probe reports speculators' own metrics (models/eagle3/metrics.py) on packed, padded batches
whose labels are the export's last states through speculators' verifier norm and LM head. This
script recounts them by hand: the labels from transformers' own forward of the target (its logits'
argmax over the draft vocabulary at each position, never the export's states), the drafter run on
one row at a time (no packing, no padding), and the draft chain counted with speculators' alignment
(models/eagle3/data.py `shift_batch`: the draft from the context ending at token t+1 predicts the
target's argmax at positions t+1+k, k = 0..draft_length-1; a position counts where the loss mask
marks its token, as speculators' prepare-data marks the answer tokens).

argv: spec.json ({"verifier", "arm": a speculators_probe arm, "label_checks": {name: export}})
out.json. Writes the metrics' sums ("probe"), the hand counts ("oracle") and, for the arm's eval
export and each export of "label_checks", the share of its eval rows' positions where the label
speculators reads from it is the target's own argmax ("label_agreement": {name: share}).
"""

import json
import sys
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "include" / "eagle3_data" / "stages" / "probe"))
import speculators_probe


def hand_counts(drafts: list[np.ndarray], labels: np.ndarray, mask: np.ndarray) -> dict[str, list[int]]:
    """full/cond hits and totals per draft step for one row (T tokens): drafts[k][t] is the draft at
    step k from the context ending at token t+1; labels[p] the target's argmax at position p."""
    steps, length = len(drafts), len(labels) - 1
    out = {key: [0] * steps for key in ("full_sum", "full_total", "cond_sum", "cond_total")}
    alive = mask[1:].astype(bool).copy()  # the drafts that start inside the answer
    for k in range(steps):
        starts = np.arange(length - k)
        right = drafts[k][starts] == labels[starts + 1 + k]
        counted = mask[starts + 1 + k].astype(bool)
        out["cond_total"][k] = int(alive[starts].sum())
        alive[starts] &= right
        out["full_sum"][k] = out["cond_sum"][k] = int((alive[starts] & counted).sum())
        out["full_total"][k] = int(counted.sum())
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    arm, verifier = spec["arm"], spec["verifier"]
    model, result = speculators_probe.train_arm(spec, arm)
    export = Path(arm["eval"])
    t2d = np.load(Path(arm["vocab_dir"]) / f"t2d-{arm['draft_vocab']}.npy").astype(bool)
    target = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    table = datasets.load_from_disk(str(export)).with_format("numpy")
    steps = arm["draft_length"]
    oracle = {key: [0] * steps for key in ("full_sum", "full_total", "cond_sum", "cond_total")}
    agree = dict.fromkeys(["eval", *spec.get("label_checks", {})], 0)
    positions = 0
    model.eval()
    for row in arm["eval_rows"]:
        ids = torch.as_tensor(table[row]["input_ids"])
        mask = np.asarray(table[row]["loss_mask"])
        states = load_file(str(export / "hidden_states" / f"hs_{row}.safetensors"))["hidden_states"].float()
        with torch.no_grad():
            labels = target(ids[None]).logits[0][:, torch.from_numpy(t2d)].argmax(-1).numpy()
            exported = model.verifier_lm_head(model.verifier_norm(states[:, -1])).argmax(-1).numpy()
            length = len(ids) - 1
            drafts = model(
                hidden_states=states[:-1, :3].flatten(1)[None],
                input_ids=ids[1:][None],
                document_ids=torch.zeros(1, length, dtype=torch.long),
                position_ids=torch.arange(1, len(ids))[None],
                ttt_steps=steps,
            )
        agree["eval"] += int((labels == exported).sum())
        positions += len(labels)
        for name, other in spec.get("label_checks", {}).items():
            states = load_file(str(Path(other) / "hidden_states" / f"hs_{row}.safetensors"))["hidden_states"].float()
            with torch.no_grad():
                read = model.verifier_lm_head(model.verifier_norm(states[:, -1])).argmax(-1).numpy()
            agree[name] += int((labels == read).sum())
        for key, values in hand_counts([d[0].numpy() for d in drafts], labels, mask).items():
            oracle[key] = [a + b for a, b in zip(oracle[key], values)]
    last = result["curve"][-1]
    probe = {
        "full_sum": last["full_acc_sum"],
        "full_total": last["full_acc_total"],
        "cond_sum": last["cond_acc_sum"],
        "cond_total": last["cond_acc_total"],
    }
    Path(sys.argv[2]).write_text(
        json.dumps({"probe": probe, "oracle": oracle, "label_agreement": {k: v / positions for k, v in agree.items()}})
    )


if __name__ == "__main__":
    main()
