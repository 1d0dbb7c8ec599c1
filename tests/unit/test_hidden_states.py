"""Hidden-state extraction on the tiny DeepSeek-V3, checked against an independent forward.

The reference is a plain `AutoModelForCausalLM` forward of one sample with
`output_hidden_states=True` (no hooks, no batching, no padding), run in fp32. Tolerance: states
are stored in bf16 by default whatever the forward computed in (fp32 here on CPU), so
|stored - ref| <= 2^-8 |ref| (one bf16 rounding) + 1e-5 (fp32 summation-order noise between a
padded batch and a single sample). With `storage_dtype="fp32"` only the 1e-5 noise remains.
"""

from __future__ import annotations

import json

import pytest
import torch

from eagle3_data import fp8
from eagle3_data.config import HiddenStatesConfig
from eagle3_data.errors import UserError
from eagle3_data.exports.shards import ShardReader, resolve_storage_dtype
from eagle3_data.stages.hidden_states.backends import TransformersBackend
from eagle3_data.stages.hidden_states.export import export_specforge
from eagle3_data.stages.hidden_states.extract import CorruptHiddenStates, extract_rows, plan_batches
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices


def assert_bf16_close(stored: torch.Tensor, ref: torch.Tensor, rel: float = 2**-8) -> None:
    err = (stored.float() - ref.float()).abs()
    bound = ref.float().abs() * rel + 1e-5
    assert bool((err <= bound).all()), f"max excess {float((err - bound).max())}"


def tensor_dtypes(path) -> dict[str, str]:
    """The dtypes written in the safetensors header, not what a reader converts them to."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_slice(name).get_dtype() for name in f.keys()}


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return TransformersBackend(tiny_model_dir)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def rows():
    g = torch.Generator().manual_seed(7)
    lengths = [3, 41, 17, 64, 9, 28, 50, 5]
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 163_840, (n,), generator=g).tolist()
        ids[-1] = 163586  # <|im_end|>
        out.append({"sample_id": f"s{i}", "input_ids": ids, "loss_mask": [0] * (n // 2) + [1] * (n - n // 2)})
    return out


def reference_states(model, ids) -> tuple:
    with torch.no_grad():
        return model(torch.tensor([ids]), output_hidden_states=True).hidden_states


def reference_pre_norm(model, ids) -> torch.Tensor:
    """The last decoder layer's output, before the final norm (transformers' hidden_states[-1] is after it)."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.setdefault("x", out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        hook.remove()
    return captured["x"][0]


def read_all(out_dir) -> dict:
    return {s.sample_id: s for p in sorted(out_dir.glob("*.safetensors")) for s in ShardReader(p)}


def test_layer_conventions_name_the_same_tensors():
    assert default_layer_ids(61, "output") == [1, 29, 57]
    assert default_layer_ids(61, "input") == [2, 30, 58]
    for L in (8, 61):
        assert hidden_state_indices(default_layer_ids(L, "output"), "output", L) == hidden_state_indices(
            default_layer_ids(L, "input"), "input", L
        )
    assert hidden_state_indices([1], "output", 8) == [2] and hidden_state_indices([1], "input", 8) == [1]
    with pytest.raises(UserError, match="out of range"):
        hidden_state_indices([7], "output", 8)  # the last layer's raw output is not in hidden_states
    with pytest.raises(UserError, match="convention"):
        default_layer_ids(8, "outputs")


def test_plan_batches_respects_budget_and_covers_every_sample():
    lengths = [5, 100, 7, 60, 61, 3, 300, 20]
    batches = plan_batches(lengths, 128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 128
    assert [300] in [[lengths[i] for i in b] for b in batches]  # too long for the budget: alone


def test_stored_states_equal_an_independent_forward(backend, reference_model, rows, tmp_path):
    summary = extract_rows(
        backend, rows, tmp_path, "t", HiddenStatesConfig(last_hidden=True, batch_tokens=128, shard_tokens=90)
    )
    assert summary["layer_ids"] == [1, 3, 4] and summary["samples"] == len(rows) and len(summary["files"]) > 1
    stored = read_all(tmp_path)
    for row in rows:
        s = stored[row["sample_id"]]
        hs = reference_states(reference_model, row["input_ids"])
        assert s.input_ids.tolist() == row["input_ids"] and s.loss_mask.tolist() == row["loss_mask"]
        assert s.aux_hidden_states.shape == (len(row["input_ids"]), 3 * 64)
        assert_bf16_close(s.aux_hidden_states, torch.cat([hs[2][0], hs[4][0], hs[5][0]], -1))
        pre = reference_pre_norm(reference_model, row["input_ids"])
        assert_bf16_close(s.last_hidden_states, pre)  # the default: before the final norm
        assert (s.last_hidden_states.float() - hs[-1][0]).abs().max() > 0.1 * hs[-1][
            0
        ].abs().max()  # not the normed one
        # off by one would be a different tensor, far outside the tolerance
        wrong = torch.cat([hs[1][0], hs[3][0], hs[4][0]], -1)
        assert (s.aux_hidden_states.float() - wrong).abs().max() > 10 * 2**-8 * wrong.abs().max()


def test_storage_dtype_bf16_by_default_whatever_the_compute_dtype(backend, reference_model, rows, tmp_path):
    assert backend.describe().dtype == "float32"  # CPU forward
    summary = extract_rows(backend, rows, tmp_path / "bf16", "b", HiddenStatesConfig(last_hidden=True))
    path = next((tmp_path / "bf16").glob("*.safetensors"))
    header = tensor_dtypes(path)
    assert header["aux_hidden_states"] == "BF16" and header["last_hidden_states"] == "BF16"
    meta = ShardReader(path).metadata
    assert (meta["dtype"], meta["compute_dtype"], meta["aux_encoding"]) == ("bfloat16", "float32", "bf16")
    assert (summary["dtype"], summary["compute_dtype"]) == ("bfloat16", "float32")

    # fp32 keeps the forward's precision: equal to the reference up to summation-order noise only
    extract_rows(
        backend,
        rows,
        tmp_path / "fp32",
        "f",
        HiddenStatesConfig(last_hidden=True, last_hidden_norm="post", storage_dtype="fp32"),
    )
    path = next((tmp_path / "fp32").glob("*.safetensors"))
    assert tensor_dtypes(path)["aux_hidden_states"] == "F32" and ShardReader(path).metadata["dtype"] == "float32"
    stored = read_all(tmp_path / "fp32")
    for row in rows[:3]:
        s = stored[row["sample_id"]]
        hs = reference_states(reference_model, row["input_ids"])
        assert_bf16_close(s.aux_hidden_states, torch.cat([hs[2][0], hs[4][0], hs[5][0]], -1), rel=1e-5)
        assert_bf16_close(s.last_hidden_states, hs[-1][0], rel=1e-5)  # post: the model's own final norm's output
        assert not torch.equal(s.aux_hidden_states, s.aux_hidden_states.bfloat16().float())  # not bf16-rounded
    # "compute" keeps whatever the forward ran in: fp32 on CPU
    extract_rows(backend, rows[:2], tmp_path / "compute", "c", HiddenStatesConfig(storage_dtype="compute"))
    reader = ShardReader(path)
    assert reader.last_hidden_norm == "post" and reader.final_norm[1] == backend.final_norm[1]
    assert torch.equal(reader.final_norm[0], reference_model.model.norm.weight.detach().float())
    assert tensor_dtypes(next((tmp_path / "compute").glob("*.safetensors")))["aux_hidden_states"] == "F32"
    assert resolve_storage_dtype("compute", "bfloat16") == torch.bfloat16
    unvalidated = HiddenStatesConfig.model_construct(storage_dtype="fp16")  # the config refuses it first
    with pytest.raises(UserError, match="storage dtype 'fp16': expected one of bf16, fp32, compute"):
        extract_rows(backend, rows[:1], tmp_path / "bad", "x", unvalidated)


def test_conventions_store_the_same_tensors(backend, rows, tmp_path):
    extract_rows(backend, rows, tmp_path / "out", "o", HiddenStatesConfig(convention="output"))
    extract_rows(backend, rows, tmp_path / "in", "i", HiddenStatesConfig(convention="input"))
    a, b = read_all(tmp_path / "out"), read_all(tmp_path / "in")
    for sid in a:
        assert torch.equal(a[sid].aux_hidden_states, b[sid].aux_hidden_states)
    reader = ShardReader(next((tmp_path / "in").glob("*.safetensors")))
    assert reader.layer_ids == [2, 4, 5] and reader.convention == "input"


def reference_logprobs(model, ids) -> torch.Tensor:
    """transformers' own forward and LM head: log p(ids[i] | ids[:i]) for i >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def test_target_logprobs_equal_the_models_own_forward_and_head(backend, reference_model, rows, tmp_path):
    summary = extract_rows(
        backend, rows, tmp_path, "l", HiddenStatesConfig(last_hidden=False, batch_tokens=128, shard_tokens=90)
    )
    stored = read_all(tmp_path)
    trained = []
    for row in rows:
        s = stored[row["sample_id"]]
        assert s.last_hidden_states is None and s.target_logprobs.dtype == torch.float32
        assert torch.isnan(s.target_logprobs[0]) and not torch.isnan(s.target_logprobs[1:]).any()
        ref = reference_logprobs(reference_model, row["input_ids"])
        assert torch.allclose(s.target_logprobs[1:], ref, atol=1e-4, rtol=0), row["sample_id"]
        mask = torch.tensor(row["loss_mask"][1:], dtype=torch.bool)
        trained.append(ref[mask].double())
    every = torch.cat(trained)
    figures = summary["logprobs"]
    assert figures["trained_tokens"] == every.numel()
    assert figures["mean_trained_logprob"] == pytest.approx(float(every.mean()), abs=1e-4)
    assert sum(len(s["least_likely_samples"]) for s in figures["sources"].values()) == 5
    # each least likely sample keeps its first trained ids and their log-probabilities (the report decodes them)
    by_id = {r["sample_id"]: r for r in rows}
    for side in figures["sources"].values():
        for w in side["least_likely_samples"]:
            row = by_id[w["sample_id"]]
            mask = torch.tensor(row["loss_mask"][1:], dtype=torch.bool)
            assert w["ids"] == torch.tensor(row["input_ids"][1:])[mask][:64].tolist(), w["sample_id"]
            ref = reference_logprobs(reference_model, row["input_ids"])[mask][:64]
            assert torch.allclose(torch.tensor(w["logprobs"]), ref, atol=1e-4, rtol=0), w["sample_id"]


def test_target_logprobs_do_not_depend_on_packing_and_barely_on_batching(backend, rows, tmp_path):
    """Each sample's log-probabilities come from its own states, chunked from its own start: shards
    cut anywhere hold the same bits; another batching moves the fp32 states by ~1e-6 only."""
    extract_rows(backend, rows, tmp_path / "a", "a", HiddenStatesConfig(batch_tokens=128, shard_tokens=40))
    extract_rows(backend, rows, tmp_path / "b", "b", HiddenStatesConfig(batch_tokens=128, shard_tokens=10_000))
    extract_rows(backend, rows, tmp_path / "c", "c", HiddenStatesConfig(batch_tokens=1))
    a, b, c = read_all(tmp_path / "a"), read_all(tmp_path / "b"), read_all(tmp_path / "c")
    for sid in a:
        assert torch.equal(a[sid].target_logprobs.nan_to_num(), b[sid].target_logprobs.nan_to_num())
        assert torch.allclose(a[sid].target_logprobs[1:], c[sid].target_logprobs[1:], atol=1e-4, rtol=0)


def test_batched_and_unbatched_agree(backend, rows, tmp_path):
    extract_rows(backend, rows, tmp_path / "one", "x", HiddenStatesConfig(batch_tokens=1))  # every sample alone
    extract_rows(backend, rows, tmp_path / "all", "x", HiddenStatesConfig(batch_tokens=10_000))  # one padded batch
    alone, batched = read_all(tmp_path / "one"), read_all(tmp_path / "all")
    for sid in alone:
        # both sides are bf16 roundings of fp32 values ~1e-6 apart: a rounding may flip by one bf16
        # ulp, up to 2^-7 relative (7 stored mantissa bits), not the 2^-8 of one rounding
        assert_bf16_close(batched[sid].aux_hidden_states, alone[sid].aux_hidden_states.float(), rel=2**-7)


class Wrapped:
    """A backend around the real one (fault injection at the backend seam): all but `forward` is the inner one's."""

    def __init__(self, inner):
        self.inner = inner

    def describe(self):
        return self.inner.describe()

    @property
    def final_norm(self):
        return self.inner.final_norm

    @property
    def lm_head(self):
        return self.inner.lm_head


class NaNAfter(Wrapped):
    """Fault injection around the real backend: corrupts one sample's states."""

    def __init__(self, inner, victim_len, mode):
        super().__init__(inner)
        self.victim_len, self.mode = victim_len, mode

    def forward(self, batch, indices, last_hidden):
        out = self.inner.forward(batch, indices, last_hidden)
        for ids, st in zip(batch, out):
            if len(ids) == self.victim_len:
                if self.mode == "nan":
                    st.aux = st.aux.clone()
                    st.aux[2, 5] = float("nan")
                else:
                    st.aux = st.aux[:-1]
        return out


@pytest.mark.parametrize(
    "mode,match",
    [
        ("nan", "sample s2: aux_hidden_states holds NaN/Inf at token positions \\[2\\]"),
        ("short", "sample s2: aux_hidden_states has 16 rows for 17 tokens"),
    ],
)
def test_corrupt_states_fail_loudly_naming_the_sample(backend, rows, tmp_path, mode, match):
    with pytest.raises(CorruptHiddenStates, match=match):
        extract_rows(NaNAfter(backend, 17, mode), rows, tmp_path, "x", HiddenStatesConfig())
    assert not list(tmp_path.glob("*.safetensors"))


def test_bad_records_are_refused_before_compute(backend, rows, tmp_path):
    bad = [dict(rows[0]), {**rows[1], "loss_mask": rows[1]["loss_mask"][:-1]}]
    with pytest.raises(UserError, match="sample s1: field loss_mask has 40 entries for 41 input_ids"):
        extract_rows(backend, bad, tmp_path, "x", HiddenStatesConfig())
    with pytest.raises(UserError, match="sample s0: field input_ids holds id 163840"):
        extract_rows(backend, [{**rows[0], "input_ids": [1, 2, 163840]}], tmp_path, "x", HiddenStatesConfig())


def test_reader_random_access_and_fp8(backend, rows, tmp_path):
    extract_rows(backend, rows, tmp_path / "bf16", "x", HiddenStatesConfig(last_hidden=False, shard_tokens=10**6))
    extract_rows(
        backend, rows, tmp_path / "fp8", "x", HiddenStatesConfig(last_hidden=False, shard_tokens=10**6, fp8=True)
    )
    exact = ShardReader(next((tmp_path / "bf16").glob("*.safetensors")))
    small = ShardReader(next((tmp_path / "fp8").glob("*.safetensors")))
    assert exact.num_tokens == sum(len(r["input_ids"]) for r in rows)
    assert exact.get("s3").input_ids.tolist() == rows[3]["input_ids"]
    assert [s.sample_id for s in exact] == exact.sample_ids
    a, q = exact.get("s6").aux_hidden_states.float(), small.get("s6").aux_hidden_states.float()
    rel = float((a - q).norm() / a.norm())
    assert 0 < rel < 0.05  # e4m3: ~2^-4 per value worst case, ~3% in norm
    assert small.get("s6").aux_hidden_states.dtype == torch.bfloat16  # dequantised to the storage dtype
    assert tensor_dtypes(small.path)["aux_hidden_states"] == "F8_E4M3"
    bf16_bytes = next((tmp_path / "bf16").glob("*")).stat().st_size
    fp8_bytes = next((tmp_path / "fp8").glob("*")).stat().st_size
    assert fp8_bytes < 0.65 * bf16_bytes


def test_fp8_round_trip_error_is_measured_per_row():
    x = torch.randn(32, 3 * 64) * torch.tensor([1.0, 100.0, 0.01]).repeat_interleave(64)
    q, scale = fp8.quantize_rows(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (32, 3)
    assert fp8.relative_error(x, 3) < 0.05
    back = fp8.dequantize_rows(q, scale, torch.float32)
    small = slice(128, 192)  # the 0.01-scale layer keeps its own resolution
    assert float((back[:, small] - x[:, small]).norm() / x[:, small].norm()) < 0.05


def test_export_to_specforge_layout(backend, rows, tmp_path):
    extract_rows(backend, rows, tmp_path / "shards", "x", HiddenStatesConfig(last_hidden=True, shard_tokens=100))
    n = export_specforge(sorted((tmp_path / "shards").glob("*.safetensors")), tmp_path / "sf")
    assert n == len(rows)
    assert len(list((tmp_path / "sf").rglob("*.ckpt"))) == len(rows)
    index = [json.loads(line) for line in (tmp_path / "sf/index.jsonl").read_text().splitlines()]
    stored = read_all(tmp_path / "shards")
    extract_rows(backend, rows, tmp_path / "post", "x", HiddenStatesConfig(last_hidden_norm="post", shard_tokens=100))
    post = read_all(tmp_path / "post")
    assert sorted(e["sample_id"] for e in index) == sorted(stored)
    for entry in index:
        d = torch.load(tmp_path / "sf" / entry["file"])
        assert set(d) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        sid = entry["sample_id"]
        T = len(stored[sid].input_ids)
        assert d["input_ids"].tolist() == stored[sid].input_ids.tolist()
        assert d["input_ids"].shape == (T,) and d["hidden_state"].shape == (1, T, 64)
        assert d["aux_hidden_state"].shape == (1, T, 192)
        assert torch.equal(d["aux_hidden_state"][0], stored[sid].aux_hidden_states)
        # stored before the norm (the default): the export applies the recorded final norm, giving SpecForge
        # what a post-norm extraction stores, up to bf16 roundings on both sides (the pre state is rounded
        # before the norm here, the normed state after it there)
        assert_bf16_close(d["hidden_state"][0], post[sid].last_hidden_states.float(), rel=2**-6)
        assert not torch.equal(d["hidden_state"][0], stored[sid].last_hidden_states)
    with pytest.raises(UserError, match="last_hidden_states"):
        extract_rows(backend, rows[:2], tmp_path / "nolast", "x", HiddenStatesConfig(last_hidden=False))
        export_specforge(sorted((tmp_path / "nolast").glob("*.safetensors")), tmp_path / "sf2")


def test_storage_estimate_at_kimi_size():
    """~57 KB per token in bf16 at H = 7168 (4H values of 2 bytes), ~28.7 KB in speculators' fp8:
    ~8.3 TB for 145 M tokens."""
    from eagle3_data.storage_estimate import describe, estimate

    est = estimate(145_000_000, 7168)
    per = est["bytes_per_token"]
    assert per["shards_bf16"] == 4 * 7168 * 2 + 5 + 4 and per["speculators_fp8"] == 4 * 7168 + 12  # + fp32 logprob
    assert 57_000 < per["speculators_bf16"] < 57_400 and 28_600 < per["speculators_fp8"] < 28_800
    assert 8.2e12 < est["bytes"]["shards_bf16"] < 8.4e12
    assert "shards_bf16 8.32 TB" in describe(est)
    assert estimate(10, 7168, last=False)["bytes_per_token"]["shards_bf16"] == 3 * 7168 * 2 + 5 + 4
    assert estimate(10, 7168, logprobs=False)["bytes_per_token"]["shards_bf16"] == 4 * 7168 * 2 + 5


class Faulty(Wrapped):
    """The anchors' silent extraction failures, injected at the backend seam around the real one:
    states shifted by one position (`shift`), a batch-mate's states (`batchmate`: each sample gets
    the states of the next sample of its batch, cut or padded to its length), the last state taken
    one layer early (`early`; `layer`: another hidden_states index taken as the last state, one the
    extraction captures anyway, so an engine whose captured layers are fixed needs no restart)."""

    def __init__(self, inner, mode, layer: int | None = None):
        super().__init__(inner)
        self.mode, self.layer = mode, layer

    def forward(self, batch, indices, last_hidden):
        L = self.inner.describe().num_layers
        if self.mode == "early" and self.layer is not None:
            out = self.inner.forward(batch, indices, last_hidden)
            k = indices.index(self.layer)
            for st in out:
                h = st.last.shape[-1]
                st.last = st.aux[:, k * h : (k + 1) * h]
            return out
        if self.mode == "early":
            out = self.inner.forward(batch, indices + [L - 1], last_hidden)
            for st in out:
                h = st.last.shape[-1]
                st.aux, st.last = st.aux[:, :-h], st.aux[:, -h:]
            return out
        out = self.inner.forward(batch, indices, last_hidden)
        if self.mode == "shift":
            for st in out:
                st.aux, st.last = torch.roll(st.aux, 1, 0), torch.roll(st.last, 1, 0)
        elif self.mode == "batchmate" and len(out) > 1:
            lasts = [st.last for st in out]
            for k, st in enumerate(out):
                other = lasts[(k + 1) % len(out)]
                n = st.last.shape[0]
                st.last = torch.cat([other, other.new_zeros(max(0, n - other.shape[0]), other.shape[1])])[:n]
        return out


def engine_answers_of(model, rows):
    """What an engine that generated each row's second half would have reported: transformers'
    own log-probabilities of those ids (the oracle, not the extractor's head)."""
    from eagle3_data.target_head.verify import EngineAnswer

    out = {}
    for row in rows:
        first = len(row["input_ids"]) // 2
        out[row["sample_id"]] = EngineAnswer(tuple(reference_logprobs(model, row["input_ids"])[first - 1 :].tolist()))
    return out


@pytest.mark.parametrize("mode", [None, "shift", "batchmate", "early"])
def test_the_extraction_proves_itself_against_the_engines_logprobs(mode, backend, reference_model, rows, tmp_path):
    from eagle3_data.target_head.verify import ExtractionDisagrees, LogprobCheck

    rows = [{**r, "prompt_tokens": len(r["input_ids"]) // 2} for r in rows if len(r["input_ids"]) > 4]
    check = LogprobCheck.for_dtype(engine_answers_of(reference_model, rows), "float32")
    run = lambda: extract_rows(
        Faulty(backend, mode) if mode else backend,
        rows,
        tmp_path,
        "v",
        HiddenStatesConfig(batch_tokens=256),
        check=check,
    )
    if mode is None:
        summary = run()["logprob_check"]
        assert summary["compared_samples"] == len(rows) and summary["failed_samples"] == 0
        assert summary["worst_mean_abs_diff"] < 1e-4  # fp32 on both sides: noise far below the tolerance
        return
    with pytest.raises(
        ExtractionDisagrees,
        match=r"local answers differ from the engine's own .* sample s\d+: mean "
        r"\|diff\| .* first at position \d+",
    ):
        run()
    assert check.failures and all(f["mean_abs_diff"] > 100 * check.tolerance for f in check.failures)


def test_specforge_export_leaves_image_samples_out_and_names_them(backend, rows, tmp_path):
    """SpecForge's offline format holds no images: an image sample is not written, and the
    export says which and why (`left_out.jsonl`), the others as before."""
    from eagle3_data.images import NO_IMAGES_IN_FORMAT

    extract_rows(backend, rows, tmp_path / "shards", "x", HiddenStatesConfig(last_hidden=True, shard_tokens=100))
    with_images = {rows[1]["sample_id"]: [{"uri": "s3://b/k", "sha256": "0" * 64, "media_tokens": 4}]}
    n = export_specforge(sorted((tmp_path / "shards").glob("*.safetensors")), tmp_path / "sf", images=with_images)
    index = [json.loads(line) for line in (tmp_path / "sf/index.jsonl").read_text().splitlines()]
    left = [json.loads(line) for line in (tmp_path / "sf/left_out.jsonl").read_text().splitlines()]
    assert n == len(rows) - 1 == len(index) and len(list((tmp_path / "sf").rglob("*.ckpt"))) == n
    assert rows[1]["sample_id"] not in {e["sample_id"] for e in index}
    assert left == [{"sample_id": rows[1]["sample_id"], "reason": NO_IMAGES_IN_FORMAT}]


def _kept_by_vllms_rule(logits: torch.Tensor, temperature: float, top_p: float, margin: float) -> torch.Tensor:
    """Per vocabulary id: +1 kept clearly inside the nucleus, -1 removed clearly outside, 0 near the
    boundary, by vLLM's own rule written out here (ops/topk_topp_sampler.py apply_top_k_top_p_pytorch:
    sort ascending, cumulative softmax of logits / T, remove where it is <= 1 - p)."""
    probs, order = torch.softmax(logits.double() / temperature, -1).sort()
    cum = probs.cumsum(-1)
    side = torch.zeros_like(cum, dtype=torch.long)
    side[cum > 1 - top_p + margin] = 1
    side[cum <= 1 - top_p - margin] = -1
    return torch.empty_like(side).scatter_(-1, order, side)


@pytest.mark.parametrize("temperature", [0.8, 1.0])
def test_nucleus_counts_the_answer_tokens_outside_the_sampling_and_not_where_it_cannot_tell(
    backend, reference_model, tmp_path, temperature
):
    """Random answers scored against the reference model's own logits by vLLM's rule (top_p 0.9;
    temperature 0.8, and 1.0, where the extraction reuses the log-softmax's normaliser): the
    extraction counts every token clearly outside the nucleus and none clearly inside (a token
    within 0.02 of the boundary may go either way: the margins), whatever the shards; greedy rows,
    rows sampled with a penalty, without a nucleus or without an answer start are not counted."""
    import json as _json

    from eagle3_data.nucleus import Nucleus
    from eagle3_data.stages.hidden_states.extract import _logprob_totals

    g = torch.Generator().manual_seed(29)
    sampling = {"temperature": temperature, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0}
    rows, clear, near, inside = [], {"vllm": 0, "openrouter": 0}, {"vllm": 0, "openrouter": 0}, 0
    for i, source in enumerate(["vllm", "openrouter", "vllm", "openrouter"]):
        ids = torch.randint(0, 163_584, (26,), generator=g).tolist()
        prompt = 6
        with torch.no_grad():  # every other answer token the model's likeliest there: inside, mostly
            likeliest = reference_model(torch.tensor([ids])).logits[0].argmax(-1).tolist()
            ids[prompt::2] = likeliest[prompt - 1 : -1 : 2]
            logits = reference_model(torch.tensor([ids])).logits[0].float()
        # logits[pos - 1] predict ids[pos]
        side = _kept_by_vllms_rule(logits[prompt - 1 : -1], temperature, 0.9, 0.02).gather(
            1, torch.tensor(ids[prompt:])[:, None]
        )
        clear[source] += int((side == -1).sum())
        near[source] += int((side == 0).sum())
        inside += int((side == 1).sum())
        rows.append(
            {
                "sample_id": f"n{i}",
                "source": source,
                "input_ids": ids,
                "loss_mask": [0] * prompt + [1] * (len(ids) - prompt),
                "prompt_tokens": prompt,
                "provenance": _json.dumps({"sampling": sampling}),
            }
        )
    not_checked = [
        {**rows[1], "sample_id": "greedy", "provenance": _json.dumps({"sampling": {**sampling, "temperature": 0}})},
        {
            **rows[1],
            "sample_id": "penalty",
            "provenance": _json.dumps({"sampling": {**sampling, "presence_penalty": 1}}),
        },
        {**rows[1], "sample_id": "whole", "provenance": _json.dumps({"sampling": {**sampling, "top_p": 1.0}})},
        {**rows[1], "sample_id": "no-start", "prompt_tokens": None},
    ]
    assert Nucleus.of({"temperature": 1.0, "top_k": 5}) == Nucleus(1.0, 1.0, 5)
    options = HiddenStatesConfig(last_hidden=False, batch_tokens=64, shard_tokens=30)
    whole = extract_rows(backend, rows + not_checked, tmp_path / "whole", "w", options)["logprobs"]["sources"]
    for source in clear:
        got = whole[source]["nucleus"]
        assert clear[source] <= got["outside"] <= clear[source] + near[source], (source, got, clear, near)
        assert got["tokens"] == 2 * 20 and got["samples"] == 2, got
    assert min(clear.values()) > 0 and inside >= 10, (clear, inside)  # both kinds on both paths
    # shards split otherwise add up to the same figures, bit for bit
    halves = [
        extract_rows(backend, part, tmp_path / f"h{k}", "h", HiddenStatesConfig(last_hidden=False, batch_tokens=1))
        for k, part in enumerate((rows[:1] + not_checked, rows[1:]))
    ]
    added = _logprob_totals(halves)["logprobs"]["sources"]
    assert {s: added[s]["nucleus"] for s in added} == {s: whole[s]["nucleus"] for s in whole}
