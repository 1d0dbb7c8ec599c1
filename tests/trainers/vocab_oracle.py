"""Run in .venv-speculators: both trainers' own vocabulary code over a merge's draft-vocabulary files.
argv: folder, N, target vocab size. Prints JSON: what each trainer's code made of them."""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from specforge.core.compact_teacher import validate_vocab_mapping_consistency
from speculators.train.cli import _load_mappings
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

folder, n, vocab = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
freq = torch.load(folder / "token_freq.pt", weights_only=True)
d2t, t2d, size = _load_mappings(folder / f"d2t-{n}.npy", folder / f"t2d-{n}.npy", n)  # the trainer's loader
rebuilt_d2t, rebuilt_t2d = build_vocab_mappings_from_distribution(freq, n, vocab)  # its builder, from our counts
# SpecForge: its draft model's buffers (llama3_eagle.py) take the mapping through load_vocab_mapping's copy_
mapping = torch.load(folder / f"vocab_mapping-{n}.pt")
sf_t2d, sf_d2t = torch.ones(vocab, dtype=torch.bool), torch.zeros(n, dtype=torch.int64)
sf_t2d.copy_(mapping["t2d"])
sf_d2t.copy_(mapping["d2t"])
validate_vocab_mapping_consistency(sf_t2d, sf_d2t)
print(
    json.dumps(
        {
            "size": size,
            "speculators_loaded_equals_its_builder": bool(
                torch.equal(d2t, rebuilt_d2t) and torch.equal(t2d, rebuilt_t2d)
            ),
            "specforge_equals_speculators": bool(torch.equal(sf_d2t, d2t) and torch.equal(sf_t2d, t2d.bool())),
            "freq_total": int(sum(freq.values())),
            "d2t_dtype": str(np.load(folder / f"d2t-{n}.npy").dtype),
        }
    )
)
