"""Llama 3.1-3.3's RoPE scaling (rope_type "llama3") end to end: from-hf of a scaled Llama gives transformers' logits
beyond the original context (and in KV-cached decoding), to-hf writes the scaling back for every family, and a
megadiff model trained with it exports to models transformers runs alike. The scaling is from 16 positions, so that
it changes most of these tiny models' frequencies."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from megadiff.checkpoint.format import checkpoint_config
from megadiff.config import ConfigError, build_config
from megadiff.convert import convert_from_hf, convert_to_hf
from megadiff.inference import load_checkpoint
from tests.convert_worker import MODEL, VARIANTS, build_tokenizer, save_in_process
from tests.test_convert_llama import stock_llama

SCALING = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}
LLAMA_3_1, LLAMA_3_2 = {**SCALING, "factor": 8.0}, {**SCALING, "factor": 32.0}
LENGTH = 48  # three times the original context


def _ids(vocab_size: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, LENGTH), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scaling", [LLAMA_3_1, LLAMA_3_2], ids=["factor8", "factor32"])
def test_a_llama3_scaled_llama_converts_and_comes_back(tmp_path, scaling):
    """from-hf refused every Llama 3.1, 3.2 and 3.3 (rope_type llama3)."""
    llama = stock_llama(tmp_path / "llama", tied=False, rope_parameters=scaling)
    checkpoint = convert_from_hf(tmp_path / "llama", tmp_path / "megadiff")
    assert checkpoint_config(checkpoint).model.rope_scaling.model_dump() == scaling
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(checkpoint)(ids), llama(input_ids=ids).logits, rtol=1e-4,
                                   atol=2e-5)

    exported = convert_to_hf(checkpoint, tmp_path / "back")
    written = json.loads((exported / "config.json").read_text())
    assert written["rope_parameters"] == llama.config.rope_parameters
    # transformers 4.x reads the scaling from rope_scaling alone
    assert written["rope_scaling"] == scaling
    original = load_file(str(tmp_path / "llama" / "model.safetensors"))
    back = load_file(str(exported / "model.safetensors"))
    assert back.keys() == original.keys() and all(torch.equal(back[name], original[name]) for name in original)


def test_kv_cached_decoding_of_a_scaled_llama_gives_the_full_forward_pass(tmp_path):
    stock_llama(tmp_path / "llama", tied=False, rope_parameters=LLAMA_3_2)
    ours = load_checkpoint(convert_from_hf(tmp_path / "llama", tmp_path / "megadiff"))
    ids, prompt = _ids(), 20
    cache = ours.new_cache(batch_size=2)
    with torch.no_grad():
        steps = [ours.hidden_states(ids[:, :prompt], cache=cache)]
        steps += [ours.hidden_states(ids[:, i:i + 1], cache=cache) for i in range(prompt, LENGTH)]
        cached = ours.output_logits(torch.cat(steps)).transpose(0, 1)
        torch.testing.assert_close(cached, ours(ids), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("variant, remote_code, family", [
    ("softmax", False, "LlamaForCausalLM"), ("diff", False, "DiffLlamaForCausalLM"),
    ("dint", True, "MegadiffForCausalLM")])
def test_a_model_trained_with_the_scaling_exports_to_the_same_model(tmp_path, variant, remote_code, family):
    tokenizer = str(build_tokenizer(tmp_path / "tokenizer"))
    scaling = [f"model.rope_scaling.{key}={value}" for key, value in LLAMA_3_1.items()]
    cfg = build_config({}, MODEL + VARIANTS[variant] + scaling + ["model.seq_length=64", f"data.tokenizer={tokenizer}"])
    ours = save_in_process(cfg, tmp_path / "checkpoint")
    exported = convert_to_hf(tmp_path / "checkpoint", tmp_path / "hf", remote_code=remote_code)
    theirs = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=remote_code)
    assert type(theirs).__name__ == family
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits[..., :300], ours(ids)[..., :300], rtol=1e-4,
                                   atol=2e-5)
    back = checkpoint_config(convert_from_hf(exported, tmp_path / "back"))
    assert back.model.rope_scaling == cfg.model.rope_scaling


def test_llama3_scaling_whose_high_frequency_factor_is_not_above_the_low_one_is_refused():
    """Equal, the interpolation between them divides by zero: the middle frequencies NaN."""
    with pytest.raises(ConfigError, match=r"model.rope_scaling.high_freq_factor: 1.0 must exceed low_freq_factor"):
        build_config({}, ["model.rope_scaling.high_freq_factor=1"])


def test_a_continued_run_may_set_the_scaling_as_it_may_the_rope_base(tmp_path):
    """A length extension of a converted Llama 3 (or of a 4K megadiff model) changes the scaling with the context,
    the weights' shapes and meaning kept."""
    from megadiff.training.state import _check_same_model

    saved = build_config({}, ["model.rope_theta=500000"])
    extended = build_config({}, ["model.rope_theta=500000", "model.rope_scaling.factor=32"])
    _check_same_model(saved, extended, tmp_path, own=True)
