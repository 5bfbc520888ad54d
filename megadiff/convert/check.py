"""The self-check of every conversion: logits of megadiff and Hugging Face on the same tokens.

Both sides run in fp32 on 2 sequences of 16 token ids drawn (seed 0) from the tokenizer's
vocabulary, one after the other (only one fp32 model in memory). The conversion fails unless
  max |logits_megadiff - logits_hf| <= max_abs_diff * max(1, max |logits_megadiff|)
  fraction of positions with the same argmax >= top1_agreement
with the thresholds below: EXACT when both sides hold the same weights, CAST when
the export rounded them (--dtype, or DiffLlama's o_proj fold in bf16/fp16).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megadiff.convert.hf_layout import ConversionError

CHECK_BATCH, CHECK_TOKENS, CHECK_SEED = 2, 16, 0


@dataclass(frozen=True)
class Thresholds:
    max_abs_diff: float    # relative to max(1, largest |logit|)
    top1_agreement: float


EXACT = Thresholds(max_abs_diff=1e-4, top1_agreement=0.99)
CAST = Thresholds(max_abs_diff=5e-2, top1_agreement=0.90)


def thresholds_for(family: str, source_dtype: torch.dtype, target_dtype: torch.dtype) -> Thresholds:
    """EXACT unless the Hugging Face weights were rounded: a dtype change, or DiffLlama's head-norm
    fold into o_proj computed in a low precision."""
    lossless = source_dtype == target_dtype and (family != "diffllama" or target_dtype == torch.float32)
    return EXACT if lossless else CAST


@dataclass(frozen=True)
class CheckResult:
    max_abs_diff: float
    scale: float
    top1_agreement: float

    def summary(self) -> str:
        return (f"max |logit diff| {self.max_abs_diff:.2e} (logit scale {self.scale:.2f}), "
                f"top-1 agreement {self.top1_agreement:.1%}")


def check_tokens(vocab_in_use: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(CHECK_SEED)
    return torch.randint(0, vocab_in_use, (CHECK_BATCH, CHECK_TOKENS), generator=generator)


@torch.no_grad()
def megadiff_logits(model, vocab_in_use: int) -> torch.Tensor:
    """The check's logits of a megadiff model (fp32, on any device), on the CPU."""
    return model(check_tokens(vocab_in_use)).float().cpu()


@torch.no_grad()
def hf_logits(model, vocab_in_use: int) -> torch.Tensor:
    """The check's logits of a Hugging Face model (fp32, on any device), on the CPU."""
    return model(input_ids=check_tokens(vocab_in_use).to(model.device)).logits.float().cpu()


def compare_logits(ours: torch.Tensor, theirs: torch.Tensor, thresholds: Thresholds) -> CheckResult:
    """Each side's logits, computed with its model alone in memory (two fp32 models of 13B: 104 GB)."""
    if ours.shape != theirs.shape:
        raise ConversionError(f"check failed: megadiff logits {tuple(ours.shape)} vs Hugging Face "
                              f"{tuple(theirs.shape)}")
    for side, logits in (("megadiff", ours), ("Hugging Face", theirs)):
        if not logits.isfinite().all():  # NaN compares false with any bound: it would pass
            raise ConversionError(f"check failed: the {side} logits are not finite (NaN or inf)")
    scale = max(1.0, float(ours.abs().max()))
    result = CheckResult(max_abs_diff=float((ours - theirs).abs().max()), scale=scale,
                         top1_agreement=float((ours.argmax(-1) == theirs.argmax(-1)).float().mean()))
    if result.max_abs_diff > thresholds.max_abs_diff * scale or result.top1_agreement < thresholds.top1_agreement:
        raise ConversionError(
            f"check failed: {result.summary()}; allowed: diff <= {thresholds.max_abs_diff:g} x scale, top-1 >= "
            f"{thresholds.top1_agreement:.0%}")
    return result
