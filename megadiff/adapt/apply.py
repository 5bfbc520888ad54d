"""Turn a pretrained transformers causal LM into its Dex or DAA form, in place.

    model = AutoModelForCausalLM.from_pretrained(path)
    apply_dex(model, calibration=[input_ids, ...])   # or apply_daa(model, {"method": "diff_k"})
    for step, batch in enumerate(data):
        set_step(model, step)                         # lambda(t) annealing
        ...

At step 0 the adapted model's logits equal the original's exactly.
"""
from __future__ import annotations

import fnmatch
import warnings
from typing import Iterable, Optional

import torch
from torch import nn

from megadiff.adapt.config import CONTROL_METHOD, DAA_METHODS, AdaptationConfig, AdaptationError, coerce_config
from megadiff.adapt.modeling_adapted import ADAPTED_ATTENTION, EXPORT_CLASSES, AdaptedAttention, install_adapters
from megadiff.adapt.selection import select_heads
from megadiff.ops.lambdas import depth_lambda_init

# without real data, calibration falls back to this many random tokens per batch
RANDOM_CALIBRATION_TOKENS = 128


def supported_model_names() -> str:
    return ", ".join(cls.__name__ for cls in EXPORT_CLASSES)


def check_supported(model: nn.Module) -> None:
    if not isinstance(model, tuple(EXPORT_CLASSES)):
        raise AdaptationError(f"Dex/DAA adapt {supported_model_names()} (transformers); got "
                              f"{type(model).__name__}")
    attentions = [layer.self_attn for layer in model.model.layers]
    if any(isinstance(a, AdaptedAttention) for a in attentions):
        raise AdaptationError(f"{type(model).__name__} is already adapted")
    unknown = {type(a).__name__ for a in attentions if type(a) not in ADAPTED_ATTENTION}
    if unknown:
        raise AdaptationError(f"unsupported attention module(s) {sorted(unknown)}; expected one of "
                              f"{[cls.__name__ for cls in ADAPTED_ATTENTION]}")


def random_calibration(model: nn.Module, count: int, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, model.config.vocab_size, (1, RANDOM_CALIBRATION_TOKENS), generator=generator)
            for _ in range(count)]


def validate_given_heads(heads: list[list[int]], num_layers: int, num_heads: int) -> None:
    if len(heads) != num_layers:
        raise AdaptationError(f"adaptation.selected_heads: {len(heads)} layers given, the model has {num_layers}")
    for layer, row in enumerate(heads):
        if not row or len(set(row)) != len(row) or not all(0 <= h < num_heads for h in row):
            raise AdaptationError(f"adaptation.selected_heads[{layer}]: {row} must be distinct head indices "
                                  f"in [0, {num_heads})")


def plan_adaptation(model: nn.Module, config: AdaptationConfig,
                    calibration: Optional[Iterable[torch.Tensor]] = None, document_eos: Optional[int] = None) -> dict:
    """The `adaptation` dict (see modeling_adapted) for this model: heads and lambda_init per layer (no layer for
    the control). `document_eos`: measure the calibration batches attending within their documents."""
    check_supported(model)
    return {
        "method": config.method,
        "anneal_steps": config.anneal_steps,
        "step": 0,
        "lambda_learn_init": config.lambda_learn_init,
        "daa_weight_before_rope": True,
        # the control adapts no layer: it selects (and measures) nothing
        "layers": [] if config.method == CONTROL_METHOD else _planned_layers(model, config, calibration, document_eos),
    }


def _planned_layers(model: nn.Module, config: AdaptationConfig, calibration: Optional[Iterable[torch.Tensor]],
                    document_eos: Optional[int]) -> list[dict]:
    """Per layer, the adapted heads and lambda_init."""
    num_layers, num_heads = len(model.model.layers), model.config.num_attention_heads
    selection = config.resolved_selection
    if selection == "given":
        validate_given_heads(config.selected_heads, num_layers, num_heads)
        heads = [sorted(row) for row in config.selected_heads]
    else:
        batches = list(calibration) if calibration is not None else None
        if selection != "all" and not batches:
            warnings.warn(f"no calibration batches given: measuring head {selection} on random tokens")
            batches = random_calibration(model, config.calibration_batches)
        heads = select_heads(model, selection, config.heads_fraction, batches, document_eos)
    return [{"heads": row, "lambda_init": (depth_lambda_init(i) if config.lambda_init == "depth"
                                           else float(config.lambda_init))}
            for i, row in enumerate(heads)]


def has_tied_head(model: nn.Module) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


def set_trainable(model: nn.Module, patterns: list[str]) -> list[str]:
    """requires_grad = name matches one of the fnmatch patterns; returns the trained names."""
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise AdaptationError(f"adaptation.trainable: {pattern!r} matches no parameter of the model")
    trained = []
    for name, param in model.named_parameters():
        param.requires_grad_(any(fnmatch.fnmatchcase(name, p) for p in patterns))
        if param.requires_grad:
            trained.append(name)
    return trained


def adapts(plan: dict) -> bool:
    """Whether a plan installs adapters: every method's does, the control's not."""
    return plan["method"] != CONTROL_METHOD


def adapt_with_plan(model: nn.Module, plan: dict, trainable: list[str]) -> nn.Module:
    """Install a planned adaptation (e.g. one saved by an earlier run) and apply the freeze policy (the
    control's plan installs nothing: its model stays the stock one)."""
    check_supported(model)
    if adapts(plan):
        install_adapters(model, plan)
    set_trainable(model, trainable)
    return model


def _apply(model, config, calibration, methods) -> nn.Module:
    config = coerce_config(config, methods)
    return adapt_with_plan(model, plan_adaptation(model, config, calibration),
                           config.trainable_patterns(has_tied_head(model)))


def apply_dex(model: nn.Module, config: AdaptationConfig | dict | None = None,
              calibration: Optional[Iterable[torch.Tensor]] = None) -> nn.Module:
    """Dex (Kong et al. 2025) on a Llama / Qwen2 / Mistral causal LM, in place; returns the model.
    `calibration`: input_ids batches [B, N] for entropy/importance head selection."""
    return _apply(model, config, calibration, ("dex",))


def apply_daa(model: nn.Module, config: AdaptationConfig | dict | None = None,
              calibration: Optional[Iterable[torch.Tensor]] = None) -> nn.Module:
    """DAA (method 'daa', default) or its ablations 'diff_q', 'diff_k', 'diff_v', in place."""
    return _apply(model, config, calibration, DAA_METHODS)


def adapted_modules(model: nn.Module) -> list[AdaptedAttention]:
    # by what they hold, not their class: an export loaded with trust_remote_code has its own copy of it
    return [m for m in model.modules() if isinstance(m, AdaptedAttention) or hasattr(m, "adapter_method")]


def set_step(model: nn.Module, step: int) -> None:
    """The annealing step t of lambda(t); the training loop calls it every step."""
    modules = adapted_modules(model)
    if not modules:
        raise AdaptationError("set_step: the model has no Dex/DAA layers (apply_dex/apply_daa first)")
    for module in modules:
        module.step = step


def current_lambdas(model: nn.Module) -> dict[str, float]:
    """lambda(t) of each adapted layer as computed in its last forward ('layer_<i>', 0-based)."""
    modules = adapted_modules(model)
    if not modules:
        return {}
    with torch.no_grad():
        lambdas = [module.current_lambda() if module.last_lambda is None else module.last_lambda for module in modules]
    # read from the device at once: a float() each waited on it once per layer, at every logged step
    values = torch.cat([lam.reshape(1).float() for lam in lambdas]).tolist()
    return {f"layer_{module.layer_idx}": value for module, value in zip(modules, values)}
