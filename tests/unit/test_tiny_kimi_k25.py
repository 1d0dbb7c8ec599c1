"""`dev:tiny-kimi-k25`: Kimi-K2.5's own class, config and checkpoint layout, loadable offline."""

from __future__ import annotations

import json
import re

# Moonshot's checkpoint names, as vLLM's loader reads them (vllm/model_executor/models/kimi_k25.py
# `hf_to_vllm_mapper`: `mm_projector.proj.0/2`; kimi_k25_vit.py: `vision_tower.patch_embed.*`,
# `vision_tower.encoder.blocks.N.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}`, `.final_layernorm`;
# the text stack is DeepseekV2ForCausalLM under `language_model.`) and as transformers' kimi_k25
# conversion mapping takes them in (`language_model.model` -> `model.language_model`, ...).
LAYOUT = [
    r"language_model\.model\.embed_tokens\.weight",
    r"language_model\.model\.norm\.weight",
    r"language_model\.lm_head\.weight",
    r"language_model\.model\.layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight",
    (
        r"language_model\.model\.layers\.\d+\.self_attn\.(q_a_proj|q_a_layernorm|q_b_proj|kv_a_proj_with_mqa|"
        r"kv_a_layernorm|kv_b_proj|o_proj)\.weight"
    ),
    r"language_model\.model\.layers\.\d+\.mlp\.(experts\.\d+\.|shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight",
    r"language_model\.model\.layers\.\d+\.mlp\.gate\.(weight|e_score_correction_bias)",
    r"vision_tower\.patch_embed\.proj\.(weight|bias)",
    r"vision_tower\.patch_embed\.pos_emb\.weight",
    r"vision_tower\.encoder\.blocks\.\d+\.(norm0|norm1|wqkv|wo|mlp\.fc0|mlp\.fc1)\.(weight|bias)",
    r"vision_tower\.encoder\.final_layernorm\.(weight|bias)",
    r"mm_projector\.pre_norm\.(weight|bias)",
    r"mm_projector\.proj\.[02]\.(weight|bias)",
]


def test_checkpoint_keys_are_moonshots_layout(tiny_kimi_k25_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_kimi_k25_dir / "model.safetensors"), framework="pt") as st:
        keys = list(st.keys())
    stray = [k for k in keys if not any(re.fullmatch(p, k) for p in LAYOUT)]
    assert stray == []
    assert {k.split(".")[3] for k in keys if k.startswith("language_model.model.layers.")} == {str(i) for i in range(8)}
    assert {k.split(".")[3] for k in keys if k.startswith("vision_tower.encoder.blocks.")} == {"0", "1"}
    assert any(".mlp.experts.7." in k for k in keys) and any("kv_a_proj_with_mqa" in k for k in keys)  # MoE + MLA
    cfg = json.loads((tiny_kimi_k25_dir / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and cfg["vision_config"]["num_hidden_layers"] == 2
    assert cfg["text_config"]["topk_method"] == "noaux_tc" and cfg["text_config"]["scoring_func"] == "sigmoid"


def test_transformers_loads_it_back_exactly(tiny_kimi_k25_dir, kimi_tokenizer):
    """transformers' own loader (its checkpoint conversion, the vision q/k rope permutation
    included) gives back every tensor of the model that was saved, none missing or left over."""
    import torch
    from transformers import Kimi_K25ForConditionalGeneration

    from eagle3_data.builds.tiny_kimi_k25 import tiny_kimi_k25_model
    from tests.fixtures.model import TINY_MODEL_ARGS

    loaded, info = Kimi_K25ForConditionalGeneration.from_pretrained(
        str(tiny_kimi_k25_dir), dtype=torch.bfloat16, output_loading_info=True
    )
    assert {k: v for k, v in info.items() if v} == {}
    built = tiny_kimi_k25_model(kimi_tokenizer, **TINY_MODEL_ARGS).state_dict()
    got = loaded.state_dict()
    assert sorted(got) == sorted(built)
    differing = [k for k in built if not torch.equal(got[k], built[k])]
    assert differing == []


def test_special_ids_are_the_tokenizers(tiny_kimi_k25_dir, kimi_tokenizer):
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(tiny_kimi_k25_dir))
    tok = kimi_tokenizer.convert_tokens_to_ids
    assert cfg.image_token_id == tok("<|media_pad|>") and kimi_tokenizer.decode([cfg.image_token_id]) == "<|media_pad|>"
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (tok("<|media_begin|>"), tok("<|media_end|>"))
    assert cfg.text_config.vocab_size == len(kimi_tokenizer) == 163_840
    assert cfg.text_config.eos_token_id == tok("[EOS]") and not cfg.tie_word_embeddings


def test_its_text_stack_is_the_tiny_deepseek_v3_weight_for_weight(tiny_kimi_k25_dir, tiny_model_dir):
    """The same seed gives the same text model in both classes: every text tensor of the K2.5
    checkpoint equals the tiny DeepSeek-V3's, and so do the logits of transformers' own forwards of
    each (the two checkpoints read back by their own loaders) for the same ids. What the engine
    tier measured on the DeepSeek-V3 (the policy trials' power, the peaked distributions) holds for
    the K2.5's text, and the DeepSeek-V3 is the same target wherever it still stands in."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Kimi_K25ForConditionalGeneration

    k25 = load_file(str(tiny_kimi_k25_dir / "model.safetensors"))
    dsv3 = load_file(str(tiny_model_dir / "model.safetensors"))
    text = {k.removeprefix("language_model."): v for k, v in k25.items() if k.startswith("language_model.")}
    assert sorted(text) == sorted(dsv3)
    assert [k for k in dsv3 if not torch.equal(text[k], dsv3[k])] == []

    ids = torch.randint(0, 163_584, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = Kimi_K25ForConditionalGeneration.from_pretrained(str(tiny_kimi_k25_dir), dtype=torch.float32)
        theirs = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        assert torch.equal(ours.eval()(input_ids=ids).logits, theirs.eval()(input_ids=ids).logits)
