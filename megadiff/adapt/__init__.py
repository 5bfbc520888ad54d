"""Dex and DAA: adapt pretrained Hugging Face causal LMs (Llama, Qwen2, Mistral) into differential
attention, and fine-tune them with DeepSpeed ZeRO (`megadiff adapt CONFIG`). No megatron here."""
from megadiff.adapt.apply import (
    adapt_with_plan, adapted_modules, apply_daa, apply_dex, current_lambdas, plan_adaptation,
    set_step, set_trainable,
)
from megadiff.adapt.config import AdaptationConfig, AdaptationError
from megadiff.adapt.modeling_adapted import annealed_lambda

__all__ = [
    "AdaptationConfig", "AdaptationError", "adapt_with_plan", "adapted_modules", "annealed_lambda", "apply_daa",
    "apply_dex", "current_lambdas", "plan_adaptation", "set_step", "set_trainable",
]
