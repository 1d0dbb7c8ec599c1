"""Run in the speculators venv (never imported by the library): an export read back by its trainer's
own code, for `eagle3-data check-export` (exports/check.py).

For each asked-for row this loads the sample with the trainer's dataset, applies the shift its
trainer applies before the loss, and writes what the loss will pair:
- speculators 0.9.0: `ArrowDataset` (with `FP8Transfer` for an fp8 export) then `shift_batch`
  (train/data.py; what `CollateFn(preprocess=shift_batch)` runs). After it, position t holds the
  drafter's input token `input_ids[t]`, the aux states `hidden_states[t]`, the verifier's state
  `verifier_last_hidden_states[t]` of that same token (before the final norm: the drafter applies
  its frozen `verifier_norm`) and `loss_mask[t]`; the verifier's logits from state t are the
  target distribution of the next token, `input_ids[t + 1]`.
- SpecForge 0.2.0: `OfflineEagle3Dataset` (data/preprocessing.py), whose `target` is the normed
  last state and `hidden_state` the aux states, then its trainer's `TargetHead.preprocess`
  (modeling/target/target_head.py), which shifts `input_ids` and `target` left by one: the target
  head's logits at t come from `target[t]`, the state of token `input_ids[t]`, and predict the
  next token.

Which original position each output came from is measured, not assumed: the same dataset code
and shift run over a copy of the row whose every tensor holds its own position index.

argv: a JSON spec {"layout": "speculators"|"specforge", "export": dir, "rows": [...], "files":
{row: ckpt path} (SpecForge), "out": dir, "vocab": {"dir": folder, "n": N, "vocab_size": V}|null}.
Writes `{out}/row_{row}.safetensors` (`state` [n, H] the states the loss pairs with `target`
[n], the token each predicts, `target_pos` [n] its original position, `mask` [n] the loss mask
on that pair, `mask_pos` [n], `aux` [m, 3H] the aux states the drafter reads, `aux_pos` [m]) and
prints one JSON line: {"rows": [...], "unavailable": {row: why}, "vocab": {...}|null}.
"""

import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


def _index(like: torch.Tensor, axis: int) -> torch.Tensor:
    """A tensor shaped like `like` whose every entry holds its 1-based position along `axis` (0
    then marks a value the trainer's code made itself: padding, a zeroed entry); float64 for
    states, so an index survives the float ops of the trainer's code."""
    n = like.shape[axis]
    dtype = torch.float64 if like.is_floating_point() else torch.int64
    shape = [1] * like.dim()
    shape[axis] = n
    return torch.arange(1, n + 1, dtype=dtype).reshape(shape).expand(like.shape).clone()


def _pos(index: torch.Tensor) -> torch.Tensor:
    return index.long() - 1  # back to 0-based; -1: made by the trainer's code


def speculators_row(dataset, row: int) -> dict[str, Any]:
    """speculators: after `shift_batch` position t holds input_ids[t] = x[t+1], aux g[t], the
    verifier's state y[t+1] of x[t+1] and loss_mask l[t+1]; the loss's target distribution at t
    is the verifier's logits from y[t+1]: the next token, input_ids[t + 1] = x[t+2]."""
    from speculators.models.eagle3 import shift_batch
    from speculators.train.recovery import SampleUnavailable

    sample = dataset[row]
    if isinstance(sample, SampleUnavailable) or not isinstance(sample, dict):
        raise RuntimeError(f"speculators' dataset served no sample ({sample})")
    shifted = shift_batch(dict(sample))
    probe = dict(sample)
    for key in ("input_ids", "hidden_states", "verifier_last_hidden_states", "loss_mask"):
        probe[key] = _index(sample[key], 0)
    where = shift_batch(probe)
    ids, last, mask = shifted["input_ids"], shifted["verifier_last_hidden_states"], shifted["loss_mask"]
    n = ids.shape[0] - 1  # state t predicts input_ids[t + 1]
    return {
        "state": last[:n].contiguous(),
        "state_pos": _pos(where["verifier_last_hidden_states"][:n, 0]).contiguous(),
        "target": ids[1:].long().contiguous(),
        "target_pos": _pos(where["input_ids"][1:]).contiguous(),
        "mask": mask[:n].long().contiguous(),
        "mask_pos": _pos(where["loss_mask"][:n]).contiguous(),
        "aux": shifted["hidden_states"].contiguous(),
        "aux_pos": _pos(where["hidden_states"][:, 0]).contiguous(),
    }


def specforge_row(path: str, max_len: int) -> dict[str, Any]:
    """SpecForge: `OfflineEagle3Dataset` (its last loss_mask entry zeroed), then its trainer's
    `TargetHead.preprocess` (training/strategies/base.py, offline `target_repr == "hidden_state"`):
    input_ids and target shifted left by one (`padding(..., left=False)`, a zero at the end), the
    loss mask as it is. Position t then holds input_ids[t] = x[t+1], the normed state y[t+1] of
    it, aux g[t], loss_mask l[t]; the target head's logits from y[t+1] are the distribution of the
    next token, input_ids[t + 1] = x[t+2]."""
    from specforge.data.preprocessing import OfflineEagle3Dataset, list_local_files
    from specforge.modeling.target.target_head import TargetHead

    if path not in list_local_files(str(Path(path).parent)):
        raise RuntimeError(f"{path}: SpecForge's list_local_files does not list it")
    data = OfflineEagle3Dataset([path], max_len=max_len)[0]
    raw = torch.load(path, weights_only=False)
    probe = {
        "input_ids": _index(raw["input_ids"], 0),
        "loss_mask": _index(raw["loss_mask"], 0),
        "hidden_state": _index(raw["hidden_state"], 1),
        "aux_hidden_state": _index(raw["aux_hidden_state"], 1),
    }
    where = OfflineEagle3Dataset.process_data(probe, max_len)
    ids, target, mask = TargetHead.preprocess(None, data["input_ids"], data["target"], data["loss_mask"])
    w_ids, w_target, w_mask = TargetHead.preprocess(None, where["input_ids"], where["target"], where["loss_mask"])
    n = ids.shape[1] - 2  # the last position is the shift's zero padding; state t predicts input_ids[t + 1]
    return {
        "state": target[0, :n].contiguous(),
        "state_pos": _pos(w_target[0, :n, 0]).contiguous(),
        "target": ids[0, 1 : n + 1].long().contiguous(),
        "target_pos": _pos(w_ids[0, 1 : n + 1]).contiguous(),
        "mask": mask[0, :n, 0].long().contiguous(),
        "mask_pos": _pos(w_mask[0, :n, 0]).contiguous(),
        "aux": data["hidden_state"][0].contiguous(),
        "aux_pos": _pos(where["hidden_state"][0, :, 0]).contiguous(),
    }


def vocab_check(folder: Path, n: int, vocab_size: int, layout: str) -> dict[str, Any]:
    """The draft vocabulary as the trainer's loader reads it: its d2t/t2d, whether they agree with
    each other, and whether they equal speculators' own builder over the merge's token counts."""
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    if layout == "speculators":
        from speculators.train.cli import _load_mappings

        d2t, t2d, _ = _load_mappings(folder / f"d2t-{n}.npy", folder / f"t2d-{n}.npy", n)
    else:
        mapping = torch.load(folder / f"vocab_mapping-{n}.pt")
        # the draft model's buffers (modeling/draft/llama3_eagle.py) take it through copy_
        t2d, d2t = torch.ones(vocab_size, dtype=torch.bool), torch.zeros(n, dtype=torch.int64)
        t2d.copy_(mapping["t2d"])
        d2t.copy_(mapping["d2t"])
    d2t, t2d = d2t.long(), t2d.bool()
    mapped = d2t + torch.arange(d2t.numel())
    result = {"size": int(d2t.numel())}
    inside = (mapped >= 0) & (mapped < t2d.numel())
    result["consistent"] = bool(inside.all()) and torch.equal(torch.sort(mapped).values, torch.nonzero(t2d).squeeze(-1))
    if not result["consistent"]:
        chosen = set(torch.nonzero(t2d).squeeze(-1).tolist())
        bad = [i for i, t in enumerate(mapped.tolist()) if t not in chosen]
        result["first_inconsistent"] = {"draft_id": bad[0], "target_id": int(mapped[bad[0]])} if bad else None
    freq_path = folder / "token_freq.pt"
    if freq_path.exists():
        freq = torch.load(freq_path, weights_only=True)
        rebuilt_d2t, rebuilt_t2d = build_vocab_mappings_from_distribution(freq, n, vocab_size)
        rebuilt = (rebuilt_d2t.long() + torch.arange(rebuilt_d2t.numel())).tolist()
        result["equals_builder"] = bool(torch.equal(rebuilt_d2t.long(), d2t) and torch.equal(rebuilt_t2d.bool(), t2d))
        if not result["equals_builder"]:
            got = mapped.tolist()
            diff = [i for i in range(min(len(got), len(rebuilt))) if got[i] != rebuilt[i]]
            result["first_builder_difference"] = (
                {"draft_id": diff[0], "target_id": got[diff[0]], "builder_target_id": rebuilt[diff[0]]}
                if diff
                else None
            )
    result["t2d"] = t2d
    return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    export, out = Path(spec["export"]), Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    layout = spec["layout"]
    max_len = int(spec.get("max_len") or 1 << 20)
    dataset = None
    if layout == "speculators":
        from speculators.train.data import ArrowDataset

        transfer = None
        if spec.get("fp8"):
            from hs_connectors.transfer import FP8Transfer

            transfer = FP8Transfer(export / "hidden_states")
        dataset = ArrowDataset(max_len=max_len, datapath=str(export), transfer=transfer, on_missing="raise")
    done, unavailable = [], {}
    for row in spec["rows"]:
        try:
            if layout == "speculators":
                got = speculators_row(dataset, row)
            else:
                got = specforge_row(spec["files"][str(row)], max_len)
        except Exception as exc:  # the trainer's reader refused it: the check reports it, naming the row
            unavailable[str(row)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            continue
        save_file(got, str(out / f"row_{row}.safetensors"))
        done.append(row)
    vocab = None
    if spec.get("vocab"):
        v = spec["vocab"]
        vocab = vocab_check(Path(v["dir"]), int(v["n"]), int(v["vocab_size"]), layout)
        save_file({"t2d": vocab.pop("t2d").to(torch.uint8)}, str(out / "t2d.safetensors"))
    print(json.dumps({"rows": done, "unavailable": unavailable, "vocab": vocab}))


if __name__ == "__main__":
    main()
