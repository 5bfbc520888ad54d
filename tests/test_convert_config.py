"""The conversion's config mapping and self-check, unit by unit: each megadiff setting reaches the Hugging Face
config and back, a model megadiff cannot express is refused by name, and the logits check fails where it should.
(The end-to-end conversions in test_convert*.py run at the default settings, where a dropped field goes unseen.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DiffLlamaConfig, LlamaConfig

from megadiff.config import ModelConfig
from megadiff.convert.check import CAST, EXACT, compare_logits, thresholds_for
from megadiff.convert.hf_config import build_hf_config, choose_family, model_fields_from_hf
from megadiff.convert.hf_layout import ConversionError

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def test_settings_off_their_defaults_reach_the_export_and_come_back():
    """lambda_std, norm_eps, rope_theta and the window, each off its default (the tests' models keep defaults)."""
    for variant, family in (("diff", "diffllama"), ("shared_diff", "megadiff"), ("dint", "megadiff")):
        model = ModelConfig(variant=variant, num_layers=2, hidden_size=64, num_attention_heads=2, seq_length=512,
                            lambda_std=0.05, norm_eps=1e-6, rope_theta=123456.0, vocab_size=128,
                            **({"lowrank_rank": 4} if variant == "shared_diff" else {}))
        hf = build_hf_config(model, family, 128, 1, 2, torch.float32)
        assert (hf.lambda_std_dev if family == "diffllama" else hf.lambda_std) == 0.05
        fields = model_fields_from_hf(hf, "export")
        assert (fields["lambda_std"], fields["norm_eps"], fields["rope_theta"], fields["seq_length"]) == \
            (0.05, 1e-6, 123456.0, 512)


def test_a_stock_llamas_norm_epsilon_and_rope_base_are_read():
    fields = model_fields_from_hf(LlamaConfig(**SMALL, rms_norm_eps=1e-6, rope_theta=5e5), "llama")
    assert (fields["norm_eps"], fields["rope_theta"], fields["variant"]) == (1e-6, 5e5, "softmax")
    fields = model_fields_from_hf(DiffLlamaConfig(**SMALL, lambda_std_dev=0.3), "diffllama")
    assert (fields["lambda_std"], fields["num_attention_heads"], fields["variant"]) == (0.3, 2, "diff")


@pytest.mark.parametrize("setting, named", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_dropout=0.1), "attention_dropout > 0"),
    (dict(max_position_embeddings=16384, rope_parameters={
        "rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "original_max_position_embeddings": 4096}),
     "rope_type 'yarn'"),
])
def test_a_model_megadiff_cannot_express_is_refused_by_name(setting, named):
    """Converted anyway, a GELU model would run as SiLU, a YaRN-scaled one as plain RoPE: other models, silently
    where the logits check is skipped."""
    with pytest.raises(ConversionError, match=rf"llama: unsupported by megadiff: {named}"):
        model_fields_from_hf(LlamaConfig(**{**SMALL, **setting}), "llama")


def test_llama3_scaling_out_of_range_is_refused_by_name():
    """transformers only warns of a factor below 1 (which shortens the wavelengths it should lengthen)."""
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 0.5, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    with pytest.raises(ConversionError, match=r"(?s)llama: rope_parameters .*factor.*greater than or equal to 1"):
        model_fields_from_hf(LlamaConfig(**{**SMALL, "max_position_embeddings": 16384, "rope_parameters": rope}),
                             "llama")


@pytest.mark.parametrize("variant, head_norm", [("diff", False), ("dint", False), ("softmax", True)])
@pytest.mark.parametrize("remote_code", [False, True])
def test_a_head_norm_ablation_is_refused_by_the_export(variant, head_norm, remote_code):
    """The DIFF paper's table 6 models (DIFF without GroupNorm, the Transformer with it) have no Hugging Face class:
    exported anyway, the norm would be dropped from, or added to, another model."""
    model = ModelConfig(variant=variant, head_norm=head_norm)
    with pytest.raises(ConversionError, match=f"model.head_norm is {head_norm} on variant {variant}"):
        choose_family(model, remote_code)
    assert choose_family(ModelConfig(variant=variant, head_norm=not head_norm), remote_code)


def test_only_weights_rounded_by_the_export_get_the_cast_thresholds():
    assert thresholds_for("llama", torch.float32, torch.float32) is EXACT
    assert thresholds_for("llama", torch.bfloat16, torch.bfloat16) is EXACT
    assert thresholds_for("megadiff", torch.bfloat16, torch.bfloat16) is EXACT
    assert thresholds_for("diffllama", torch.float32, torch.float32) is EXACT
    assert thresholds_for("diffllama", torch.bfloat16, torch.bfloat16) is CAST  # the head norm folded in bf16
    assert thresholds_for("llama", torch.float32, torch.bfloat16) is CAST


def test_the_logits_check_fails_past_either_threshold():
    """The check is what catches a layout bug in a conversion: it must fail on a difference past its bound,
    relative to the logits' scale, and on an argmax that moved where the values barely did."""
    draw = torch.Generator().manual_seed(0)
    ours = 8 * torch.randn(2, 16, 50, generator=draw)
    scale = float(ours.abs().max())
    within = ours.clone()
    within[0, 0, 0] += 0.5 * EXACT.max_abs_diff * scale
    assert compare_logits(ours, within, EXACT).max_abs_diff == pytest.approx(0.5 * EXACT.max_abs_diff * scale, rel=1e-3)
    beyond = ours.clone()
    beyond[0, 0, 0] += 2 * EXACT.max_abs_diff * scale
    with pytest.raises(ConversionError, match="check failed: max \\|logit diff\\|"):
        compare_logits(ours, beyond, EXACT)
    compare_logits(ours, beyond, CAST)
    # every position's top two logits a hair apart, swapped: a tiny difference, another argmax everywhere
    tied = torch.zeros(2, 16, 50)
    tied[..., 0], tied[..., 1] = 1.0, 1.0 - 1e-6
    swapped = tied[..., [1, 0, *range(2, 50)]]
    with pytest.raises(ConversionError, match="top-1 agreement 0.0%"):
        compare_logits(tied, swapped, EXACT)
    with pytest.raises(ConversionError, match="megadiff logits \\(2, 16, 50\\) vs Hugging Face \\(2, 16, 49\\)"):
        compare_logits(tied, tied[..., :49], CAST)
    # NaN compares false with any bound: a model whose weights overflowed would pass on the difference
    for side in ("megadiff", "Hugging Face"):
        broken = ours.clone()
        broken[1, 3, 2] = float("nan")
        pair = (broken, ours) if side == "megadiff" else (ours, broken)
        with pytest.raises(ConversionError, match=f"check failed: the {side} logits are not finite"):
            compare_logits(*pair, CAST)


@pytest.mark.parametrize("direction", ["to-hf", "from-hf"])
def test_a_conversion_into_a_save_another_is_writing_is_refused(tmp_path, direction):
    """Two into one --save at once each removed the other's staged files as it started: an export without its
    weights, or one checkpoint's weights beside another's sidecar. The second is refused before it reads."""
    import os

    from megadiff.convert.from_hf import convert_from_hf
    from megadiff.convert.to_hf import convert_to_hf
    from megadiff.files import hold_lock

    save = tmp_path / "out"
    first = hold_lock(f"{save}.lock")  # the first conversion's, here in this process
    convert = convert_to_hf if direction == "to-hf" else convert_from_hf
    with pytest.raises(ConversionError, match=rf"--save {save} is being written by another conversion \(host .*, "
                                              rf"pid {os.getpid()}\): wait for it to end, or give another --save"):
        convert(tmp_path / "no-such-source", save)
    first.close()
    with pytest.raises(Exception, match="no-such-source"):  # its turn now: on to reading the source
        convert(tmp_path / "no-such-source", save)
    assert not save.exists() or not any(save.iterdir())
    assert not Path(f"{save}.lock").exists()  # nothing left beside the output


def test_a_save_at_the_working_directory_keeps_its_lock_beside_it(tmp_path, monkeypatch):
    """`from-hf --save .` into an empty directory: `..lock` inside it made it "not empty"."""
    from megadiff.convert.from_hf import convert_from_hf

    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.chdir(out)
    with pytest.raises(Exception, match="no-such-source"):
        convert_from_hf(tmp_path / "no-such-source", ".")
