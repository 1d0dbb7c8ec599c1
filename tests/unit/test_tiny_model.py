"""The tiny target model: deterministic from its seed, Kimi's vocabulary, loadable offline."""

from __future__ import annotations

import hashlib

from eagle3_data.cli import main
from tests.fixtures.model import TINY_MODEL_ARGS


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_other_bytes(tiny_model_dir, kimi_tokenizer_dir, tmp_path):
    args = [
        "dev",
        "build-model",
        "--tokenizer",
        str(kimi_tokenizer_dir),
        "--seed",
        str(TINY_MODEL_ARGS["seed"]),
        "--layers",
        str(TINY_MODEL_ARGS["layers"]),
        "--hidden",
        str(TINY_MODEL_ARGS["hidden"]),
    ]
    assert main(args + ["--out", str(tmp_path / "again")]) == 0
    assert sha(tmp_path / "again/model.safetensors") == sha(tiny_model_dir / "model.safetensors")
    assert main(args[:-4] + ["--layers", "4", "--hidden", "32", "--seed", "1", "--out", str(tmp_path / "s1")]) == 0
    assert sha(tmp_path / "s1/model.safetensors") != sha(tiny_model_dir / "model.safetensors")


def test_loads_offline_with_kimi_vocabulary(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # tokenizer files travel with the model
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert model.config.vocab_size == len(tok) == 163_840
    assert model.config.num_hidden_layers == 8 and model.config.hidden_size == 64
    assert tok.convert_tokens_to_ids("<|im_end|>") == 163_586
    ids = tok.encode("Let me think.</think>The answer is 42.<|im_end|>")
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    assert len(out.hidden_states) == 9 and out.logits.shape == (1, len(ids), 163_840)


def test_bad_arguments_are_user_errors(kimi_tokenizer_dir, tmp_path, capsys):
    assert main(["dev", "build-model", "--tokenizer", str(tmp_path), "--out", str(tmp_path / "m")]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
    assert (
        main(
            [
                "dev",
                "build-model",
                "--tokenizer",
                str(kimi_tokenizer_dir),
                "--out",
                str(tmp_path / "m"),
                "--layers",
                "3",
            ]
        )
        == 2
    )
