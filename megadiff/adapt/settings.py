"""The `megadiff adapt` config: YAML (`base: other.yaml` inherits) + `key.sub=value` overrides,
checked before any compute; every failure names its key.

    model:       the pretrained HF model directory (local; no hub), tokenizer, attention implementation
    adaptation:  AdaptationConfig (method, head selection, lambda, freeze policy)
    data:        local text/jsonl files, packed into seq_length tokens
    train:       iterations, batch sizes, AdamW + warmup/cosine schedule, precision, seed
    checkpoint:  DeepSpeed checkpoint interval, exit interval
    logging:     log interval, TensorBoard, Weights & Biases
    deepspeed:   a DeepSpeed JSON (configs/deepspeed/); its "auto" values are filled from `train`
    output_dir:  checkpoints/, metrics.jsonl, tensorboard/, adaptation.json, hf/ (the export)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError, field_validator

from megadiff.adapt.apply import validate_given_heads
from megadiff.adapt.config import AdaptationConfig
from megadiff.config import ConfigError, WandbFields, refuse_a_file_for_directory, validate_wandb
from megadiff.config.loader import apply_overrides, format_validation_error, load_yaml_tree
from megadiff.config.schema import StrictNumbers, expand_home, read_chat_template
from megadiff.errors import first_line

SUPPORTED_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
TEXT_SUFFIXES = (".txt", ".text", ".md")
JSON_SUFFIXES = (".json", ".jsonl")


class ModelSection(StrictNumbers):
    path: str = Field(..., description="local Hugging Face model directory (config.json + weights)")
    tokenizer: Optional[str] = Field(None, description="tokenizer directory; default: model.path")
    attn_implementation: Optional[str] = Field(None, description="transformers attention implementation "
                                               "(sdpa, eager, flash_attention_2, ...); default: transformers'")

    _expand_home = field_validator("path", "tokenizer", mode="before")(expand_home)

    @field_validator("attn_implementation")
    @classmethod
    def _known_attention(cls, name: Optional[str]) -> Optional[str]:
        """Else from_pretrained refuses it once the ranks have formed their group."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
        if name is not None and name not in known and "/" not in name:  # owner/repo: a hub kernel's
            raise ValueError(f"unknown attention implementation {name!r}; transformers has {known}")
        return name


class DataSection(StrictNumbers):
    files: list[str] = Field(..., min_length=1, description="text files (.txt/.md: one document per file) or "
                             "JSON lines (.json/.jsonl: one document per record)")
    text_key: str = Field("text", description="the text field of JSON records")
    messages_key: Optional[str] = Field(None, description="instruction tuning: the field of JSON records holding "
                                        "each conversation ({role, content} messages, or ShareGPT's {from, value} "
                                        "turns), rendered by the chat template; the loss only on the assistant's "
                                        "turns")
    chat_template: Optional[str] = Field(None, description="with messages_key: a Jinja chat template or a file "
                                         "holding it; default: the tokenizer's own")
    seq_length: int = Field(1024, ge=2, description="tokens per packed training sequence")
    seed: int = Field(1234, ge=0, description="seed of the sample order (one permutation per epoch)")
    document_masking: bool = Field(False, description="attention stays within each packed document (position "
                                   "ids restart after each EOS, from which transformers masks), in training "
                                   "and head selection")
    cache_dir: Optional[str] = Field(None, description="datasets cache; default: the datasets library's")
    workers: int = Field(1, ge=1, description="processes tokenizing the files, on each node's first rank (the "
                         "other ranks read its cache); the packed sequences are the same for any number")

    _read_chat_template = field_validator("chat_template")(read_chat_template)
    _expand_home = field_validator("files", "cache_dir", mode="before")(expand_home)


class TrainSection(StrictNumbers):
    iters: int = Field(..., ge=1, description="optimizer steps")
    micro_batch_size: int = Field(1, ge=1, description="sequences per rank per micro-step")
    grad_accum: int = Field(1, ge=1, description="micro-steps per optimizer step")
    lr: float = Field(1e-4, gt=0, description="peak learning rate (Dex: 1e-4)")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="linear warmup, share of iters")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine decay ends at lr x this")
    weight_decay: float = Field(0.0, ge=0)
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, ge=0, description="0 = no clipping")
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    max_skipped_nan_iters: int = Field(10, ge=0, description="the steps DeepSpeed skips for a non-finite loss or "
                                       "gradient (bf16, fp32; fp16 under a static loss scale) a run goes on after, "
                                       "over the whole run (checkpoints carry the count): one more stops it (exit "
                                       "code 3)")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in the "
                                         "backward (transformers' gradient checkpointing): a layer's activations "
                                         "held at a time, for long sequences of large models (DAA's recipe)")
    seed: int = Field(1234, ge=0, description="seeds torch every iteration (from seed, iteration and rank): "
                                              "dropout is resumable, and each data-parallel rank draws its own masks")
    timeout_minutes: float = Field(60, gt=0, description="how long a rank waits in a collective before the job "
                                   "fails, e.g. while its node's first rank tokenizes data.files (torch's "
                                   "default, 10, is short for a large corpus)")


class CheckpointSection(StrictNumbers):
    save_interval: int = Field(500, ge=1, description="save a DeepSpeed checkpoint every N iterations")
    keep_last: Optional[int] = Field(None, ge=1, description="keep only the last N checkpoints (default: all)")
    exit_interval: Optional[int] = Field(None, ge=1, description="save and stop at iterations divisible by N "
                                         "(rerunning the command resumes)")
    exit_duration_minutes: Optional[float] = Field(None, gt=0, description="save and stop after the first "
                                                   "iteration that ends this many minutes after the run started "
                                                   "(exit code 0; rerunning the command resumes)")


class LoggingSection(StrictNumbers, WandbFields):
    log_interval: int = Field(1, ge=1)
    tensorboard: bool = True


class FinetuneConfig(StrictNumbers):
    model: ModelSection
    adaptation: AdaptationConfig = Field(default_factory=AdaptationConfig)
    data: DataSection
    train: TrainSection
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection)
    deepspeed: str = Field(..., description="DeepSpeed JSON; relative paths: from the working directory, "
                           "else from the directory of the YAML file that sets it")
    output_dir: str
    export_dir: Optional[str] = Field(None, description="the final HF directory; default: <output_dir>/hf")

    _expand_home = field_validator("deepspeed", "output_dir", "export_dir", mode="before")(expand_home)

    @property
    def resolved_export_dir(self) -> Path:
        return Path(self.export_dir) if self.export_dir else Path(self.output_dir) / "hf"


def load_finetune_config(path: str | Path | None, overrides: list[str] = ()) -> FinetuneConfig:
    data = load_yaml_tree(Path(path)) if path is not None else {}
    try:
        cfg = FinetuneConfig.model_validate(apply_overrides(data, overrides))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, FinetuneConfig)) from None
    validate_finetune(cfg)
    return cfg


def read_model_config(model_dir: str) -> dict:
    config_file = Path(model_dir) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model.path: {model_dir} is not a Hugging Face model directory (no config.json)")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"model.path: {config_file} is not JSON ({first_line(err)})") from None
    model_type = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model.path: model_type {model_type!r} is not supported; Dex/DAA adapt "
                          f"{', '.join(SUPPORTED_MODEL_TYPES.values())}")
    missing = [key for key in MODEL_SHAPE_KEYS if not isinstance(hf_config.get(key), int)]
    if missing:
        raise ConfigError(f"model.path: {config_file} gives no {', '.join(missing)}")
    _check_weight_files(Path(model_dir))
    return hf_config


# what the adaptation reads of a config.json before transformers does
MODEL_SHAPE_KEYS = ("num_hidden_layers", "num_attention_heads")


def _check_weight_files(model_dir: Path) -> None:
    """Weights there, and each safetensors file whole (its header read, as cheap as a stat): a file cut short
    by a download or copy was found by from_pretrained, after the data was tokenized."""
    from safetensors import SafetensorError, safe_open

    safetensors = sorted(model_dir.glob("*.safetensors"))
    if not safetensors and not any(model_dir.glob("pytorch_model*.bin")):
        raise ConfigError(f"model.path: {model_dir} holds no weights (*.safetensors or pytorch_model*.bin)")
    for index in model_dir.glob("*.index.json"):  # a sharded model's: every shard it names must be there
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"model.path: {index} is not a weights index ({first_line(err)})") from None
        missing = sorted(name for name in shards if not (model_dir / name).is_file())
        if missing:
            raise ConfigError(f"model.path: {index} names {', '.join(missing)}, which {model_dir} lacks")
    for file in safetensors:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ConfigError(f"model.path: {file} cannot be read ({first_line(err)}): cut short by a download or "
                              "copy?") from None


def read_deepspeed_json(path: str) -> dict:
    if not Path(path).is_file():
        raise ConfigError(f"deepspeed: {path} does not exist")
    try:
        ds = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed: {path} is not valid JSON ({err})") from None
    zero = ds.get("zero_optimization", {}) if isinstance(ds, dict) else None
    if not isinstance(zero, dict):
        raise ConfigError(f"deepspeed: {path}: expected an object with a zero_optimization object "
                          "(configs/deepspeed/zero2.json is the usual choice)")
    stage = zero.get("stage", 0)
    if stage not in (1, 2, 3):  # without ZeRO, DeepSpeed's engine has no gradient norm to report
        raise ConfigError(f"deepspeed: {path}: zero_optimization.stage must be 1, 2 or 3, not {stage!r} "
                          "(configs/deepspeed/zero2.json is the usual choice)")
    if "optimizer" in ds:  # else deepspeed_config fills in torch's AdamW
        _check_optimizer(ds["optimizer"], path)
    return ds


# the adapt config fills Adam's hyperparameters (train.adam_betas, adam_eps, weight_decay) into the JSON's
ADAM_OPTIMIZERS = ("adam", "adamw")


def _check_optimizer(optimizer, path: str) -> None:
    """DeepSpeed's own assertion met a bad optimizer only once the model had loaded."""
    if not isinstance(optimizer, dict) or not isinstance(optimizer.get("params", {}), dict):
        raise ConfigError(f"deepspeed: {path}: optimizer must be an object with a params object")
    kind = optimizer.get("type")  # without one, DeepSpeed builds no optimizer of its own
    if not isinstance(kind, str) or kind.lower() not in ADAM_OPTIMIZERS:
        raise ConfigError(f"deepspeed: {path}: optimizer.type {kind!r}: adaptation trains with Adam or AdamW "
                          "(train.adam_betas, train.adam_eps and train.weight_decay fill its params)")


def _check_sequence_length(seq_length: int, hf_config: dict, model_dir: str) -> None:
    """Positions past the base model's context are RoPE's untrained extrapolation: most often a seq_length
    meant for another model, and the export would still declare the shorter context."""
    trained = hf_config.get("max_position_embeddings")
    if isinstance(trained, int) and seq_length > trained:
        raise ConfigError(f"data.seq_length: {seq_length} is past the base model's context ({trained}, "
                          f"max_position_embeddings in {Path(model_dir) / 'config.json'}); shorten it, or, to "
                          "extend the context, raise max_position_embeddings there (with rope_scaling if the "
                          "model needs it)")


def _check_data_files(data: DataSection) -> None:
    suffixes = JSON_SUFFIXES if data.messages_key is not None else TEXT_SUFFIXES + JSON_SUFFIXES
    for i, name in enumerate(data.files):
        if Path(name).is_dir():
            raise ConfigError(f"data.files[{i}]: {name} is a directory; name its files ({', '.join(suffixes)})")
        if not Path(name).is_file():
            raise ConfigError(f"data.files[{i}]: {name} does not exist")
        if not name.endswith(suffixes):
            reads = " (data.messages_key reads JSON records)" if data.messages_key is not None else ""
            raise ConfigError(f"data.files[{i}]: {name}: expected one of {suffixes}{reads}")
    if data.chat_template is not None and data.messages_key is None:
        raise ConfigError("data.chat_template: only used with data.messages_key")


# what an adaptation run writes into its output_dir (beside config.yaml) and its export beside the weights
PLAN_FILE = "adaptation.json"
RUN_FILES = ("metrics.jsonl", "checkpoints")
MODEL_CODE_MODULE = "modeling_megadiff_adapted"


def _check_directories(cfg: FinetuneConfig) -> None:
    """The export replaces its directory whole, and a run takes its output_dir over: neither may be a
    directory of the user's. An export_dir at output_dir deleted the run, one at model.path the base model."""
    output, export = Path(cfg.output_dir).resolve(), cfg.resolved_export_dir.resolve()
    refuse_a_file_for_directory("output_dir", output, "a run writes a directory")
    if output.is_dir() and not (output / PLAN_FILE).is_file() and any((output / name).exists() for name in RUN_FILES):
        raise ConfigError(f"output_dir: {output} holds another run (its {' or '.join(RUN_FILES)}, no {PLAN_FILE}); "
                          "an adaptation run needs an output_dir of its own")
    for key, path in (("output_dir", cfg.output_dir), ("model.path", cfg.model.path), ("model.tokenizer",
                                                                                      cfg.model.tokenizer)):
        theirs = Path(path).resolve() if path else None
        if theirs is not None and (export == theirs or export in theirs.parents):
            raise ConfigError(f"export_dir: {export} is or holds {key} ({theirs}), and an export replaces its "
                              "directory whole; give the export a directory of its own")
    refuse_a_file_for_directory("export_dir", export, "an export writes a directory")
    if export.is_dir() and any(export.iterdir()) and not (export / f"{MODEL_CODE_MODULE}.py").is_file():
        raise ConfigError(f"export_dir: {export} holds files that are not an earlier export of an adapted model, "
                          "and an export replaces its directory whole; give a new or empty directory")


def check_tokenizer_fits(tokenizer, cfg: FinetuneConfig) -> None:
    """Refuse a tokenizer with ids the model has no embedding row for (another model's, or tokens added without
    resize_token_embeddings): the first batch holding one failed on an IndexError, a device-side assert on a GPU,
    after the data and the weights had loaded."""
    rows = read_model_config(cfg.model.path).get("vocab_size")
    if rows is not None and len(tokenizer) > rows:
        raise ConfigError(f"model.tokenizer: {cfg.model.tokenizer or cfg.model.path} has {len(tokenizer):,} ids, but "
                          f"the model in {cfg.model.path} embeds {rows:,} (its config.json's vocab_size): give the "
                          "model's own tokenizer, or resize the model's embeddings to it "
                          "(model.resize_token_embeddings(len(tokenizer))) and save it")


def validate_finetune(cfg: FinetuneConfig) -> None:
    """Everything that can be checked without loading weights."""
    _check_directories(cfg)
    hf_config = read_model_config(cfg.model.path)
    _check_sequence_length(cfg.data.seq_length, hf_config, cfg.model.path)
    tokenizer_dir = Path(cfg.model.tokenizer or cfg.model.path)
    if not any((tokenizer_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise ConfigError(f"model.tokenizer: no tokenizer files in {tokenizer_dir}")
    if cfg.adaptation.resolved_selection == "given":  # the control's are ignored, as a Dex recipe's are
        validate_given_heads(cfg.adaptation.selected_heads, hf_config["num_hidden_layers"],
                             hf_config["num_attention_heads"])
    _check_data_files(cfg.data)
    read_deepspeed_json(cfg.deepspeed)
    validate_wandb(cfg.logging)
