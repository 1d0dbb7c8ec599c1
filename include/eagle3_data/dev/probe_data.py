"""The probe's calibration data on the tiny target: its own generations, extracted and exported
for speculators, and the same export with one fault injected (what the probe must tell apart).

The tiny target is built with a final norm of weight 1 (a random init), under which normalising
the last state twice changes nothing; `with_trained_norm` gives a copy whose final norm has the
spread weights every trained model has (Kimi-K2.5's are far from 1), so that fault is a fault.

The faults, each a bug seen in EAGLE-3 data pipelines:
- `aux_late`: the aux states one position late (state t is token t-1's: an extra token before
  the extraction's input, or an off-by-one slice);
- `aux_early`: the aux states one position early (state t is token t+1's: the first token dropped
  from the extraction's input, or the trainer's shift applied twice): the head trains on a state
  that already holds the target's reading of the token it is given, and is scored on one that does not;
- `last_normed_twice`: the last state after the final norm, which speculators normalises again;
- `other_sample`: every sample carries the states of another sample (a shuffled join), taken from
  a sample of its own group (`groups`: the probe's train and held-out rows): states swapped across
  the split would put the held-out rows' states and labels into training, a leak that scored this
  fault far above the correct data (benchmarks/probe_faults.py);
- `mask_shifted`: the loss mask one position late (SpecForge#885);
- `wrong_layers`: aux states of other layers than the export names (a convention mix-up).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3_data import draft_vocab
from eagle3_data.target_head.final_norm import rms_norm

FAULTS = ("aux_late", "aux_early", "last_normed_twice", "other_sample", "mask_shifted", "wrong_layers")
WRONG_LAYERS = [
    4,
    5,
    6,
]  # the last three aux-capable layers of the tiny target (8 layers) instead of EAGLE-3's [1, L//2-1, L-4]


def with_trained_norm(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A copy of the target whose final norm weight is log-normal (sigma 0.5), as trained ones spread."""
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    for path in tmp.glob("*.safetensors"):
        weights = load_file(str(path))
        if "model.norm.weight" in weights:
            w = weights["model.norm.weight"]
            g = torch.Generator().manual_seed(seed)
            weights["model.norm.weight"] = torch.exp(0.5 * torch.randn(w.shape, generator=g)).to(w.dtype)
            save_file(weights, str(path), metadata={"format": "pt"})
    tmp.rename(out)
    return out


def with_previous_token_head(model_dir: Path, out: Path, *, sharpness: float = 35.0) -> Path:
    """A copy of the target whose first layer's attention reads the previous token, so that its next
    token depends on context the current token does not carry, as a real model's does.

    The random target's next token is ~80% fixed by the current token alone: a drafter then reads
    the token embedding and ignores the aux states, so no aux-state fault can show in the probe
    (benchmarks/probe_faults.py). Here layer 0's MLA attends to position t-1 with ~95% of its weight
    (every head): its query and the rope part of its key are constant vectors (the query through
    `q_a_layernorm` of one constant input dimension, the key from one embedding dimension set
    constant for every token), the query rotated one position back, so q_t . k_j peaks at j = t-1
    under the model's own rotary embedding (`sharpness`: the logit of that peak over the neighbours'
    about sharpness x 0.22); the key's content part is zeroed and the values are the random ones.
    The state at t then carries token t-1, so the target's next token depends on the one before it
    (fixed by the current token at ~54% of its answers' positions, ~80% on the random target; ~960
    distinct tokens in 64 answers at temperature 0.5 instead of ~300), and a head has a reason to read
    the aux states: a head trained on another sample's states scored worse than the correct data at
    every seed on this target and not on the random one (benchmarks/probe_faults.py, 2026-12-04,
    before the prompts ended in the chat header)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    if (out / "config.json").exists():
        return out
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    config, attn = model.config, model.model.layers[0].self_attn
    rope, nope, v_dim, heads = (
        config.qk_rope_head_dim,
        config.qk_nope_head_dim,
        config.v_head_dim,
        config.num_attention_heads,
    )

    def rotation(position: int) -> torch.Tensor:
        """The model's rotary map of one rope vector at `position`, as a matrix (column j: basis j)."""
        eye = torch.eye(rope).view(1, 1, rope, rope)
        cos, sin = model.model.rotary_emb(eye.view(1, rope, rope), torch.full((1, rope), position))
        return apply_rotary_pos_emb_interleave(eye, eye, cos, sin)[0][0, 0].T

    key = torch.zeros(rope)
    key[0:8:2] = 0.5  # the four fastest frequencies: a peak at one offset, below it everywhere else in 64
    query = torch.linalg.solve(rotation(0), rotation(-1) @ key)  # <R(t) query, R(j) key> peaks at j = t-1
    scale = float(np.sqrt(sharpness / attn.scaling))
    with torch.no_grad():
        embed = model.model.embed_tokens.weight
        embed[:, 0] = 2 * embed[:, 1:].pow(2).mean().sqrt()  # one constant input dimension
        normed = float(model.model.layers[0].input_layernorm(embed[:4096])[:, 0].mean())
        attn.q_a_proj.weight.zero_()
        attn.q_a_proj.weight[0, 0] = 1.0
        attn.q_a_layernorm.weight.fill_(1.0)  # q_a_layernorm(q_a) = sqrt(q_lora_rank) e_0 for every token
        attn.q_b_proj.weight.zero_()
        kv_rank = config.kv_lora_rank
        for h in range(heads):
            attn.q_b_proj.weight[h * (nope + rope) + nope : (h + 1) * (nope + rope), 0] = (
                query * scale / np.sqrt(config.q_lora_rank)
            )
            attn.kv_b_proj.weight[h * (nope + v_dim) : h * (nope + v_dim) + nope] = 0.0  # no content score
        attn.kv_a_proj_with_mqa.weight[kv_rank:] = 0.0
        attn.kv_a_proj_with_mqa.weight[kv_rank:, 0] = key * scale / normed
        attn.kv_a_proj_with_mqa.weight[:kv_rank, 0] = 0.0  # the values read the token, not the constant
        model.lm_head.weight[:, 0] = 0.0  # the constant dimension biases no token
    changed = {
        name: tensor
        for name, tensor in model.state_dict().items()
        if name.startswith(("model.embed_tokens.", "model.layers.0.self_attn.", "lm_head."))
    }  # the checkpoint's names (its MoE experts are stored unfused, the others as the model names them)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model_dir, tmp)
    written = set()
    for path in tmp.glob("*.safetensors"):
        weights = load_file(str(path))
        written |= changed.keys() & weights.keys()
        weights.update({name: changed[name].to(w.dtype).contiguous() for name, w in weights.items() if name in changed})
        save_file(weights, str(path), metadata={"format": "pt"})
    if written != changed.keys():
        raise ValueError(f"{model_dir}: the checkpoint lacks {sorted(changed.keys() - written)}")
    tmp.rename(out)
    return out


def own_generations(
    model_dir: Path,
    samples: int,
    *,
    prompt_tokens: int = 16,
    new_tokens: int = 48,
    temperature: float = 0.5,
    seed: int = 0,
    prompt_pool: int | None = None,
    header: list[int] | None = None,
) -> list[dict[str, Any]]:
    """Rows of the target's own sampled answers to random prompts: prompt ids masked out, answer
    ids trained, as the merge writes them. At temperature 0.5 the tiny target's answers use ~270
    distinct tokens per 1,500 (754 at 1.0), so a 256-token draft vocabulary covers ~99% of them,
    as a 32k one covers a real target's: a drafter is then judged on what it can predict. `header`:
    ids that end every prompt (`assistant_header`: a chat template's turn to the assistant, so the
    first draft after each prompt has a context of its own, as in real chat data)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    sampled = (model.lm_head.weight.abs().sum(-1) > 0).nonzero().squeeze(-1)  # ordinary text tokens
    g = torch.Generator().manual_seed(seed)
    if prompt_pool:
        sampled = sampled[torch.randperm(sampled.numel(), generator=g)[:prompt_pool]]
    header = torch.tensor(header or [], dtype=torch.long)
    prompts = sampled[torch.randint(0, sampled.numel(), (samples, prompt_tokens - len(header)), generator=g)]
    prompts = torch.cat([prompts, header.expand(samples, -1)], dim=1)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=True,
            temperature=temperature,
            top_k=0,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
    return [
        {
            "sample_id": f"s{i}",
            "input_ids": out[i].tolist(),
            "loss_mask": [0] * prompt_tokens + [1] * (out.shape[1] - prompt_tokens),
        }
        for i in range(samples)
    ]


def assistant_header(model_dir: Path) -> list[int]:
    """The ids the target's chat template puts between a user's message and the assistant's answer
    (the end of the user turn, the assistant turn's header, and the reasoning opener when thinking)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    marker = "\u2063"  # a character no template writes: where the user's message ends
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text[text.rindex(marker) + 1 :], add_special_tokens=False)


def export_rows(
    model_dir: Path,
    rows: list[dict[str, Any]],
    out: Path,
    *,
    layer_ids: list[int] | None = None,
    vocab_size: int = 256,
    device: str = "cpu",
) -> Path:
    """The rows extracted (transformers, the default EAGLE-3 layers unless `layer_ids`), exported
    for speculators, with their draft vocabulary beside the export. On the CPU by default (the
    calibration benchmarks compare fp32 states on any machine); `benchmarks/gpu_probe.py` extracts
    on its GPU in bf16, as a production run does (its defaults, ~766k tokens at Kimi's width, would
    take about an hour on the lent machine's CPU, and fp32 states twice the disk)."""
    from eagle3_data.config import HiddenStatesConfig
    from eagle3_data.exports.speculators_export import export_speculators
    from eagle3_data.stages.hidden_states.backends import TransformersBackend
    from eagle3_data.stages.hidden_states.extract import extract_rows

    shards = out.with_name(out.name + "-shards")
    extract_rows(
        TransformersBackend(model_dir, device=device),
        rows,
        shards,
        "x",
        HiddenStatesConfig(layer_ids=layer_ids, logprobs=False),
    )
    export_speculators(sorted(shards.glob("*.safetensors")), out)
    counts = np.zeros(0, dtype=np.int64)
    for r in rows:
        counts = draft_vocab.add_counts(counts, np.array(r["input_ids"]), np.array(r["loss_mask"], np.uint8))
    target_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    draft_vocab.write(out, counts, vocab_size, target_vocab)
    return out


def sample_ids(export: Path, rows: list[int]) -> list[str]:
    """The sample_ids of an export's rows (its index.jsonl)."""
    index = [json.loads(line)["sample_id"] for line in (export / "index.jsonl").read_text().splitlines()]
    return [index[row] for row in rows]


def rows_of(export: Path, ids: list[str]) -> list[int]:
    """The rows of an export holding these sample_ids: exports of the same samples need not share an
    order (the export orders rows by length), so arms that must train on the same samples map them."""
    index = [json.loads(line)["sample_id"] for line in (export / "index.jsonl").read_text().splitlines()]
    where = {sid: row for row, sid in enumerate(index)}
    return sorted(where[sid] for sid in ids)


def inject(
    fault: str,
    export: Path,
    out: Path,
    *,
    model_dir: Path,
    wrong_layers: Path | None = None,
    groups: list[list[int]] | None = None,
) -> Path:
    """A copy of `export` with `fault` in every sample (`wrong_layers`: the same rows exported with
    WRONG_LAYERS; `model_dir`: the target, for its final norm; `groups`: the rows that may swap
    states under `other_sample`, all rows one group unless given)."""
    import datasets

    from eagle3_data.exports.speculators_export import save_rows
    from eagle3_data.target_head.final_norm import checkpoint_weight

    shutil.copytree(export, out)
    files = sorted((out / "hidden_states").glob("hs_*.safetensors"), key=lambda p: int(p.stem[3:]))
    if fault == "mask_shifted":
        table = datasets.load_from_disk(str(export)).with_format("numpy")
        index = [json.loads(line)["sample_id"] for line in (export / "index.jsonl").read_text().splitlines()]
        rows = [(sid, r["input_ids"], np.concatenate([[0], r["loss_mask"][:-1]])) for sid, r in zip(index, table)]
        for name in ("data-00000-of-00001.arrow", "state.json", "dataset_info.json"):
            (out / name).unlink()
        save_rows(rows, out)
        return out
    if wrong_layers is not None and sample_ids(wrong_layers, list(range(len(files)))) != sample_ids(
        export, list(range(len(files)))
    ):
        raise ValueError(f"{wrong_layers} holds the samples in another order than {export}")
    config = json.loads((model_dir / "config.json").read_text())
    norm = checkpoint_weight(model_dir, ("model.norm.weight",))
    states = [load_file(str(p)) for p in files]
    partner = {}
    for group in groups or [list(range(len(files)))]:
        partner.update({row: group[(j + 1) % len(group)] for j, row in enumerate(group)})
    for i, path in enumerate(files):
        t = dict(states[i])
        hs = t["hidden_states"].clone()
        if fault == "aux_late":
            hs[1:, :3] = states[i]["hidden_states"][:-1, :3]
        elif fault == "aux_early":
            hs[:-1, :3] = states[i]["hidden_states"][1:, :3]
        elif fault == "last_normed_twice":
            hs[:, 3] = rms_norm(hs[:, 3], norm, config["rms_norm_eps"])
        elif fault == "other_sample":
            other = states[partner[i]]["hidden_states"]
            n = min(len(hs), len(other))
            hs[:n] = other[:n]
        elif fault == "wrong_layers":
            hs[:, :3] = load_file(str(wrong_layers / "hidden_states" / path.name))["hidden_states"][:, :3]
        else:
            raise ValueError(f"unknown fault {fault!r} (known: {', '.join(FAULTS)})")
        t["hidden_states"] = hs.contiguous()
        save_file(t, str(path))
    return out


def calibration(
    model_dir: Path,
    work: Path,
    samples: int,
    seed: int = 0,
    prompt_pool: int | None = None,
    groups: list[list[int]] | None = None,
    context: bool = False,
    vocab_size: int = 256,
    faults: tuple[str, ...] = FAULTS,
    device: str = "cpu",
) -> tuple[Path, Path, dict[str, Path]]:
    """(the target with a trained-like norm, its correct export, {fault: faulty export}) under `work`:
    `samples` of its own generations, extracted and exported, then each fault injected (`groups`:
    the probe's train and held-out rows, which `other_sample` never mixes; every prompt ends with the
    target's `assistant_header`, as a chat turn does; `context`: the target
    with a previous-token head, `with_previous_token_head`; `vocab_size`: the draft vocabulary's;
    `faults`: the ones to inject, all by default; `device`: the extraction's)."""
    target = with_trained_norm(model_dir, work / "target")
    if context:
        target = with_previous_token_head(target, work / "target-context")
    rows = own_generations(target, samples, seed=seed, prompt_pool=prompt_pool, header=assistant_header(target))
    correct = export_rows(target, rows, work / "correct", vocab_size=vocab_size, device=device)
    wrong = (
        export_rows(target, rows, work / "wrong-layers", layer_ids=WRONG_LAYERS, vocab_size=vocab_size, device=device)
        if "wrong_layers" in faults
        else None
    )
    return (
        target,
        correct,
        {f: inject(f, correct, work / f, model_dir=target, wrong_layers=wrong, groups=groups) for f in faults},
    )


def arms(correct: Path, faulty: dict[str, Path], train_rows: list[int], eval_rows: list[int], seeds: int) -> list[Any]:
    """The correct data and each fault over the same seeds, rows, held-out rows and draft vocabulary
    (the correct export's): an arm differs from the correct one by its injected fault alone, and
    every arm is scored against the trusted labels (the correct export's held-out rows). Named
    `<data>/seed<s>`."""
    from eagle3_data.stages.probe.drafter import Arm

    return [
        Arm(f"{name}/seed{s}", path, correct, train_rows, eval_rows, correct, s)
        for name, path in {"correct": correct, **faulty}.items()
        for s in range(seeds)
    ]


FIT_SIGMAS = 5  # a fault told apart by the last state fit: its top1 this many standard errors below


def top1_gap_in_standard_errors(good: dict[str, Any], other: dict[str, Any]) -> float:
    """How far `other`'s last state fit (`probe.last_state_fit`) falls below `good`'s top1 share, in
    standard errors of that difference (binomial, over each one's trained tokens): the fit has no
    seed spread, only the sampling error of its token counts. The fault benchmark and the test of
    the probe's ordering count a fault told apart by the fit at FIT_SIGMAS."""
    error = sum(f["top1"] * (1 - f["top1"]) / f["tokens"] for f in (good, other)) ** 0.5
    return (good["top1"] - other["top1"]) / error


def resplit(rows: list[dict[str, Any]], rate: float, tokenizer, seed: int = 0) -> tuple[list[dict[str, Any]], float]:
    """The rows with a share `rate` of their trained (answer) tokens re-split: one token replaced by
    two that decode to the same text, as a canonical re-encoding and the engine's sampled ids
    disagree (the seeds' "BPE re-splits"). Returns the rows and the share actually re-split."""
    rng = np.random.default_rng(seed)
    pieces: dict[int, list[int] | None] = {}

    def split_of(token: int) -> list[int] | None:
        if token not in pieces:
            text = tokenizer.decode([token])
            half = len(text) // 2
            ids = (
                (
                    tokenizer.encode(text[:half], add_special_tokens=False)
                    + tokenizer.encode(text[half:], add_special_tokens=False)
                )
                if half
                else []
            )
            pieces[token] = ids if len(ids) > 1 and tokenizer.decode(ids) == text else None
        return pieces[token]

    out, trained, done = [], 0, 0
    for row in rows:
        ids, mask = [], []
        for token, m in zip(row["input_ids"], row["loss_mask"]):
            trained += m
            new = split_of(token) if m and rng.random() < rate else None
            done += new is not None
            ids += new or [token]
            mask += [m] * len(new or [token])
        out.append({**row, "input_ids": ids, "loss_mask": mask})
    return out, done / trained if trained else 0.0
