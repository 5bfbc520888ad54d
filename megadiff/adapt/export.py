"""Save an adapted model as a Hugging Face directory that loads with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`: safetensors weights, a
config.json whose `model_type`/`auto_map` point at the bundled model code
(modeling_megadiff_adapted.py, a copy of megadiff/adapt/modeling_adapted.py), the `adaptation`
dict (method, heads, lambda_init, T and the step t the weights belong to), and the tokenizer.
The control (adaptation.method finetune) has no adapter: save_finetuned writes its stock architecture.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from torch import nn
from transformers import PretrainedConfig

from megadiff.adapt import modeling_adapted
from megadiff.adapt.config import AdaptationError
from megadiff.adapt.modeling_adapted import EXPORT_CLASSES, describe_adapters
from megadiff.adapt.settings import MODEL_CODE_MODULE
from megadiff.data.conversations import stop_ids
from megadiff.data.tokenizers import GENERATION_CONFIG, HFTokenizer, save_for_any_transformers
from megadiff.files import publish_staged, staging_dir
from megadiff.transformers4 import name_rope_for_transformers4


def adapted_classes(model: nn.Module) -> tuple[type, type, type]:
    for base, classes in EXPORT_CLASSES.items():
        if isinstance(model, base):
            return classes
    raise AdaptationError(f"cannot export {type(model).__name__}: not a Dex/DAA-adapted Llama/Qwen2/Mistral")


def adapted_config(model: nn.Module):
    """The exportable config: the base model's fields + adaptation + auto_map."""
    config_cls, model_cls, base_model_cls = adapted_classes(model)
    try:
        adaptation = describe_adapters(model)
    except ValueError as err:
        raise AdaptationError(f"{err} (apply_dex/apply_daa first)") from None
    fields = {k: v for k, v in model.config.to_dict().items() if k not in ("model_type", "architectures", "auto_map")}
    config = config_cls.from_dict({**fields, "adaptation": adaptation})
    config.architectures = [model_cls.__name__]
    config.auto_map = {"AutoConfig": f"{MODEL_CODE_MODULE}.{config_cls.__name__}",
                       "AutoModelForCausalLM": f"{MODEL_CODE_MODULE}.{model_cls.__name__}",
                       "AutoModel": f"{MODEL_CODE_MODULE}.{base_model_cls.__name__}"}
    return config


def _stop_at_turn_end(directory: Path, tokenizer) -> None:
    """The exported generation config stops at the chat template's end of turn too (ChatML's <|im_end|> on a base
    model whose EOS is <|endoftext|>, Qwen2's): a model tuned on conversations ends its replies there. The file's
    other settings stay as save_pretrained wrote them from the base model's: transformers refuses to save a changed
    GenerationConfig holding sampling settings without do_sample (Vicuna's temperature and top_p), which it reads."""
    if not tokenizer.chat_template or tokenizer.eos_token_id is None:  # no turns; megadiff's reader needs an EOS
        return
    path = directory / GENERATION_CONFIG
    fields = json.loads(path.read_text())
    template_reader = HFTokenizer(str(directory), tokenizer)
    fields["eos_token_id"] = stop_ids(fields.get("eos_token_id"), template_reader.chat_template, template_reader)
    path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def save_adapted(model: nn.Module, directory: str | Path, state_dict: Optional[dict] = None, tokenizer=None) -> Path:
    """Write the HF directory. `state_dict`: the full weights when the model's own are partitioned (ZeRO-3).
    It is written aside and named when whole: killed between the weights and the adapted config, it loaded
    as the base architecture, the adapters' weights ignored."""
    return _save(model, Path(directory), adapted_config(model), state_dict, tokenizer)


def save_finetuned(model: nn.Module, directory: str | Path, state_dict: Optional[dict] = None,
                   tokenizer=None) -> Path:
    """The control's HF directory (adaptation.method finetune): its model is the stock architecture
    (LlamaForCausalLM, ...), saved with its own config and no model code, so it loads without remote code."""
    return _save(model, Path(directory), None, state_dict, tokenizer)


def _save(model: nn.Module, directory: Path, adapted: Optional[PretrainedConfig], state_dict: Optional[dict],
          tokenizer) -> Path:
    """save_adapted's and save_finetuned's directory; `adapted`: the adapted config and model code replace the
    stock ones."""
    staged = staging_dir(directory)
    shutil.rmtree(staged, ignore_errors=True)  # a killed export's
    model.save_pretrained(staged, state_dict=state_dict)
    if adapted is not None:
        adapted.save_pretrained(staged)  # replaces the base model's config.json
        shutil.copyfile(modeling_adapted.__file__, staged / f"{MODEL_CODE_MODULE}.py")
    name_rope_for_transformers4(staged, adapted or model.config)
    if tokenizer is not None:
        save_for_any_transformers(tokenizer, staged)
        _stop_at_turn_end(staged, tokenizer)
    publish_staged(directory)
    return directory
