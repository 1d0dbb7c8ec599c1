"""The draft vocabulary: the N target tokens an EAGLE-3 drafter predicts, from the merged data.

Both trainers count `input_ids[loss_mask == 1]` over the training data and keep the N most
frequent (speculators train/vocab_mapping.py `build_vocab_mappings_from_distribution`; SpecForge
data/preprocessing.py `process_token_dict_to_mappings`). The merge counts them over the whole
vocabulary as it writes the shards, so the mapping is the data's, computed once, and written
beside the shards in each trainer's format:
- speculators: `token_freq.pt` (a {token id: count} dict, torch.save), `d2t-{N}.npy` (int64 [N]:
  target id = draft index + d2t[draft index]) and `t2d-{N}.npy` (bool [V]), the names its
  trainer looks for in its data path (train/cli.py);
- SpecForge: `vocab_mapping-{N}.pt`, torch.save({"d2t", "t2d"}) as its `--vocab-mapping-path`.
Ties are broken by token id (count descending, then id ascending: speculators' order; SpecForge's
`Counter.most_common` keeps insertion order, so its own choice can differ run to run), and a
vocabulary with fewer than N trained tokens is filled with the lowest unused ids, as speculators
does. `coverage` is the share of trained tokens whose id is inside the draft vocabulary: what
the drafter can predict at all.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

TOKEN_FREQ = "token_freq.pt"


def file_names(n: int) -> dict[str, list[str]]:
    """The files of a draft vocabulary of size n, by trainer."""
    return {"speculators": [TOKEN_FREQ, f"d2t-{n}.npy", f"t2d-{n}.npy"], "specforge": [f"vocab_mapping-{n}.pt"]}


def is_file_of(trainer: str, name: str) -> bool:
    """Whether `name` is one of the trainer's draft-vocabulary files (`file_names`, any N)."""
    if trainer == "speculators":
        return name == TOKEN_FREQ or (name.startswith(("d2t-", "t2d-")) and name.endswith(".npy"))
    return name.startswith("vocab_mapping-") and name.endswith(".pt")


def add_counts(counts: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
    """`counts` (int64 [V]) plus the trained tokens of flat id/mask arrays (grown for an id past V)."""
    trained = input_ids[loss_mask.astype(bool)]
    if trained.size and int(trained.max()) >= counts.shape[0]:
        counts = np.pad(counts, (0, int(trained.max()) + 1 - counts.shape[0]))
    return counts + np.bincount(trained, minlength=counts.shape[0]).astype(np.int64)


def select(counts: np.ndarray, n: int) -> np.ndarray:
    """The draft vocabulary's target ids, ascending: the n most trained (count desc, id asc),
    filled with the lowest unused ids when fewer than n were trained."""
    n = min(n, counts.shape[0])
    ids = np.arange(counts.shape[0])
    trained = ids[counts > 0]
    order = trained[np.lexsort((trained, -counts[trained]))]  # last key sorts first: count desc, then id
    chosen = list(order[:n])
    if len(chosen) < n:
        taken = set(int(i) for i in chosen)
        chosen += [i for i in range(counts.shape[0]) if i not in taken][: n - len(chosen)]
    return np.sort(np.asarray(chosen, dtype=np.int64))


def summary(counts: np.ndarray, n: int, chosen: np.ndarray) -> dict[str, Any]:
    """Size, coverage and counts, for the manifest and the report."""
    total = int(counts.sum())
    inside = int(counts[chosen].sum()) if chosen.size else 0
    return {
        "size": int(chosen.size),
        "requested_size": n,
        "trained_tokens": total,
        "distinct_trained": int((counts > 0).sum()),
        "coverage": inside / total if total else 0.0,
    }


def write(out_dir: Path, counts: np.ndarray, n: int, vocab_size: int) -> tuple[list[str], dict[str, Any]]:
    """Write both trainers' files into `out_dir`; returns their names and the summary."""
    import torch

    counts = counts[:vocab_size] if counts.shape[0] >= vocab_size else np.pad(counts, (0, vocab_size - counts.shape[0]))
    chosen = select(counts, n)
    size = int(chosen.size)
    d2t = chosen - np.arange(size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[chosen] = True
    freq = {int(i): int(counts[i]) for i in np.nonzero(counts)[0]}
    torch.save(freq, out_dir / TOKEN_FREQ)
    np.save(out_dir / f"d2t-{size}.npy", d2t)
    np.save(out_dir / f"t2d-{size}.npy", t2d)
    torch.save({"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}, out_dir / f"vocab_mapping-{size}.pt")
    names = file_names(size)
    return names["speculators"] + names["specforge"], summary(counts, n, chosen)
