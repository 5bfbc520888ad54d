"""The one typed config tree: model, parallel, data, train, checkpoint, logging.

Every field is documented here; YAML files under configs/ set them and
`key.sub=value` overrides refine them. Validation that needs several fields
lives in `validate_*` functions so a bad config fails before any compute,
with a message naming the key.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from megadiff.config.bundled import BUNDLED_CONFIGS

Variant = Literal["softmax", "diff", "shared_diff", "dint"]
DIFFERENTIAL_VARIANTS = ("diff", "shared_diff", "dint")


def _leaf_types(annotation) -> set:
    """The types a field's annotation holds, through Optional/Union/list/tuple (a Literal's: its values')."""
    if get_origin(annotation) is Literal:
        return {type(arg) for arg in get_args(annotation)}
    args = get_args(annotation)
    return set().union(*(_leaf_types(arg) for arg in args)) if args else {annotation}


def _holds_boolean(value) -> bool:
    return isinstance(value, bool) or (isinstance(value, (list, tuple)) and any(_holds_boolean(v) for v in value))


class StrictNumbers(BaseModel):
    """Refuses what a typo makes of a number: true for 1 (`model.num_layers=true`, also in a list of numbers),
    an infinite float (`train.lr=.inf`, which pydantic's bounds let through and which trains NaN steps)."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value, info: ValidationInfo):
        if _holds_boolean(value):
            leaves = _leaf_types(cls.model_fields[info.field_name].annotation)
            if leaves & {int, float} and not leaves & {bool, Any}:
                raise ValueError("a number is expected, not true or false")
        return value


class Section(StrictNumbers):
    model_config = ConfigDict(validate_assignment=True)


def expand_home(value):
    """`~` at the start of a path setting (or of a list's) is the home directory, as a shell makes it of a word
    it expands; `key.sub=~/x` it leaves alone (`data.cache_dir=~/cache` wrote ./~/cache)."""
    if isinstance(value, list):
        return [expand_home(item) for item in value]
    return os.path.expanduser(value) if isinstance(value, str) else value


def read_chat_template(value: Optional[str]) -> Optional[str]:
    """A chat_template setting's template: a file's (a relative path from the working directory, else
    megadiff's own: `configs/chat/chatml.jinja` names the one it ships) is read in, so a run's saved
    config holds the template itself."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = Path(value).expanduser()
    for candidate in (path, BUNDLED_CONFIGS.parent / path):
        if candidate.is_file():
            return candidate.read_text(encoding="utf-8")
    raise ValueError(f"{value!r} is neither a file nor a Jinja template")


class RopeScalingConfig(Section):
    """Llama 3.1's RoPE scaling (rope_type "llama3"): the frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those shorter than
    original_max_position_embeddings / high_freq_factor kept, the ones between interpolated. The defaults are
    Llama 3.1's (Llama 3.2's factor is 32)."""
    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(8.0, ge=1)
    low_freq_factor: float = Field(1.0, gt=0)
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position_embeddings: int = Field(8192, ge=1)


class ModelConfig(Section):
    variant: Variant = "diff"
    num_layers: int = Field(2, ge=1)
    hidden_size: int = Field(64, ge=1)
    ffn_hidden_size: Optional[int] = Field(None, ge=1, description="default: 8/3 hidden, rounded up to 64")
    num_attention_heads: int = Field(2, ge=1, description="the variant's own heads: a DIFF head holds two softmax maps")
    num_kv_heads: Optional[int] = Field(None, ge=1, description="GQA key/value heads; default = num_attention_heads")
    head_dim: Optional[int] = Field(None, ge=1, description="d: width of one Q/K map; default hidden/(2h) for "
                                    "differential variants (V is 2d wide), hidden/h for softmax")
    vocab_size: int = Field(100288, ge=2, description="tokenizer vocabulary; padded up for the embedding")
    make_vocab_size_divisible_by: int = Field(128, ge=1)
    seq_length: int = Field(4096, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: Optional[RopeScalingConfig] = Field(
        None, description="RoPE scaling of a converted Llama 3.x (docs/conversion.md); default: none")
    norm_eps: float = Field(1e-5, gt=0)
    lambda_init: Union[Literal["depth"], float] = Field(
        "depth", description="'depth': 0.8 - 0.6 exp(-0.3 (l - 1)) for layers l = 1..L")
    lambda_std: float = Field(0.1, ge=0, description="std of the normal init of the four lambda vectors")
    head_norm: Optional[bool] = Field(
        None, description="RMSNorm of each head's output (the DIFF paper's GroupNorm); default: on for the "
        "differential variants (scaled by 1 - lambda_init), off for softmax. The DIFF paper's table 6 ablates it: "
        "false on DIFF (no norm, no multiplier), true on softmax (no multiplier)")
    lowrank_rank: int = Field(0, ge=0, description="Shared DIFF: rank r of the four low-rank updates")
    lowrank_zero_init: bool = Field(True, description="Shared DIFF: B factors start at zero (update = 0)")
    init_std: float = Field(0.02, gt=0)
    tie_embeddings: bool = False
    attention_backend: Literal["auto", "triton", "sdpa", "sdpa_split_v", "reference"] = "auto"
    sdpa_kernels: Optional[list[Literal["cudnn", "flash", "efficient", "math"]]] = Field(
        None, min_length=1, description="the SDPA kernels the softmax baseline and the sdpa / sdpa_split_v "
        "backends may run, in the order torch tries them; default: torch's own order, which differs between "
        "versions (recent ones try cuDNN first on Hopper and Blackwell); see docs/performance.md")
    transformer_impl: Literal["local", "te"] = "local"

    @field_validator("sdpa_kernels")
    @classmethod
    def _each_kernel_once(cls, kernels):
        if kernels is not None and len(set(kernels)) != len(kernels):
            raise ValueError(f"names a kernel twice: {kernels}")
        return kernels


class ParallelConfig(Section):
    tensor: int = Field(1, ge=1, description="tensor-parallel size")
    pipeline: int = Field(1, ge=1, description="pipeline-parallel size")
    virtual_pipeline: Optional[int] = Field(None, ge=2, description="model chunks per pipeline rank (interleaved)")
    sequence_parallel: bool = False
    context: int = Field(1, ge=1, description="context-parallel size")
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    timeout_minutes: float = Field(30, gt=0, description="how long a rank waits in a collective before the job "
                                   "fails, e.g. while rank 0 builds dataset indices (megatron-core's default; "
                                   "torch's own is 10)")


class DataConfig(Section):
    sources: list[str] = Field(default_factory=list, description="prepare-data input: text files (json/jsonl/txt/"
                               "parquet), directories or globs of them, or a Hugging Face dataset name")
    text_key: str = Field("text", description="the field holding a document's text in json/jsonl/parquet sources")
    response_key: Optional[str] = Field(None, description="supervised fine-tuning: the field holding each record's "
                                        "response, data.text_key its prompt; the loss is then computed on the "
                                        "responses (and the EOD after each) only; see docs/data.md")
    messages_key: Optional[str] = Field(None, description="supervised fine-tuning on conversations: the field "
                                        "holding each record's list of {role, content} messages, rendered by the "
                                        "chat template; the loss is then computed on the assistant's turns only; "
                                        "see docs/data.md")
    chat_template: Optional[str] = Field(None, description="data.messages_key: the Jinja chat template, or a file "
                                         "holding it (read in, so a run's saved config holds the template); "
                                         "default: the tokenizer's own")
    prefix: Optional[str] = Field(None, description="the indexed dataset (<prefix>.bin/.idx) prepare-data writes; "
                                  "default for a bundled corpus: <cache_dir>/prepared/<corpus>-<tokenizer>")
    blend: list[Union[str, float]] = Field(default_factory=list, description="[w1, prefix1, w2, prefix2, ...] "
                                           "or [prefix, ...]; default [prefix]")
    split: str = Field("949,50,1", description="train,valid,test document proportions of every prefix")
    tokenizer: str = Field("cl100k_base", description="'cl100k_base', 'o200k_base' or a HF tokenizer directory")
    workers: int = Field(1, ge=1, description="prepare-data tokenizer processes")
    length_upsampling: bool = Field(False, description="repeat each training document in proportion to its "
                                    "length (64K extension); see docs/data.md")
    length_upsampling_unit: Optional[int] = Field(None, ge=1, description="tokens per repeat of length "
                                                  "up-sampling; default model.seq_length")
    document_masking: bool = Field(False, description="attention stays within each document packed into a "
                                   "training sequence (documents end at the tokenizer's EOD); see docs/data.md")
    eod_mask_loss: bool = Field(False, description="no loss where the input token is an EOD: the next "
                                "document's first token, which the previous document cannot predict")
    bundled_corpus: Optional[str] = Field(None, description="'kjv': a real corpus megadiff writes and prepares "
                                          "itself at the start of pre-training (demo, tests)")
    cache_dir: str = Field("data/cache", description="bundled corpora, their prepared data and megatron's "
                           "sample-index cache; must be visible to every node")

    _read_chat_template = field_validator("chat_template")(read_chat_template)
    _expand_home = field_validator("sources", "prefix", "blend", "tokenizer", "cache_dir", mode="before")(expand_home)

    @field_validator("split", mode="before")
    @classmethod
    def _one_share_is_a_split(cls, value):
        """`split: 100` (every document to training, as megatron spells it) is read by YAML as a number, which
        was refused as not a string."""
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @property
    def masks_loss(self) -> bool:
        """Prompt/response or conversation data: the loss only on some tokens, by a mask prepared beside them."""
        return self.response_key is not None or self.messages_key is not None

    @property
    def loss_mask_key(self) -> str:
        """The setting that asks for a loss mask, for messages."""
        return "data.messages_key" if self.messages_key is not None else "data.response_key"


class TrainConfig(Section):
    micro_batch_size: int = Field(1, ge=1)
    global_batch_size: int = Field(1, ge=1)
    iters: int = Field(100, ge=1)
    planned_samples: Optional[int] = Field(None, ge=1, description="the training samples the data order is drawn "
                                           "for (default: those train.iters reads). megatron shuffles a source read "
                                           "more than once for that count: a run lengthened past it later (train.iters "
                                           "raised on resume, e.g. WSD) reads such sources in another order from there")
    per_token_loss: bool = Field(False, description="the loss averaged over every loss token of the global batch "
                                 "(megatron's --calculate-per-token-loss) instead of micro-batch by micro-batch: "
                                 "with prompt/response data, whose micro-batches hold unequal response tokens, each "
                                 "token then weighs the same")
    lr: float = Field(3.2e-4, ge=0)
    min_lr: float = Field(0.0, ge=0)
    lr_warmup_iters: int = Field(0, ge=0)
    lr_decay_style: Literal["linear", "cosine", "constant", "wsd"] = Field(
        "linear", description="wsd: warmup-stable-decay, the peak lr until the last lr_wsd_decay_iters")
    lr_decay_iters: Optional[int] = Field(None, ge=1, description="default: iters")
    lr_wsd_decay_iters: Optional[int] = Field(None, ge=1, description="wsd: the final decay's length")
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    weight_decay: float = Field(0.1, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    seed: int = Field(1234, ge=0, le=2**32 - 1)
    layout_invariant_init: bool = Field(
        False, description="draw each initial weight from a generator of train.seed and the weight's name: the "
        "same model whatever the tensor/pipeline layout (megatron's default seeds each pipeline stage apart)")
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"
    fp8_backend: Literal["te", "torchao"] = Field("te", description="fp8: TransformerEngine layers (te) or "
                                                  "torch-native float8 linear layers (torchao)")
    recompute: Literal["none", "selective", "full"] = "none"
    exit_interval: Optional[int] = Field(None, ge=1, description="stop cleanly after this iteration, with a checkpoint")
    exit_duration_minutes: Optional[float] = Field(None, gt=0, description="stop cleanly, with a checkpoint, after "
                                                   "the first iteration that ends this many minutes after the run "
                                                   "started (start-up included); exit code 0, like exit_interval")
    eval_interval: Optional[int] = Field(None, ge=1)
    eval_iters: int = Field(1, ge=1)
    eval_each_source: bool = Field(False, description="with a data.blend of several prefixes: also each prefix's "
                                   "validation loss (valid_loss/<name>), eval_iters batches of each")
    max_skipped_nan_iters: int = Field(10, ge=0, description="the steps skipped for a non-finite loss or gradient "
                                       "a run goes on after, over the whole run (checkpoints carry the count): one "
                                       "more stops it")
    skip_spike_sigma: Optional[float] = Field(None, gt=0, description="skip the update of a step whose loss or "
                                              "gradient norm is more than this many standard deviations above "
                                              "the mean of the previous spike_window steps (OLMo uses 6)")
    spike_window: int = Field(128, ge=2, description="steps the spike guard's mean and deviation cover")
    dataloader_workers: int = Field(0, ge=0, description="background processes reading training samples")


class CheckpointConfig(Section):
    save_interval: Optional[int] = Field(None, ge=1)
    keep_last: Optional[int] = Field(None, ge=1)
    async_save: bool = False
    fully_parallel_save: bool = Field(
        True, description="spread the writes of what data-parallel ranks hold alike (the model's weights) over them, "
        "as Megatron-LM's --ckpt-fully-parallel-save: each of DP ranks writes about 1/DP of them, where each "
        "tensor/pipeline shard's data-parallel rank 0 wrote them all. The files are the same format")
    load: Optional[str] = Field(None, description="initial checkpoint when output_dir has none (e.g. 4K -> 64K)")
    load_optimizer: bool = True
    reset_iteration: bool = Field(False, description="with `load`: start counting iterations and data from 0")
    optimizer_format: Literal["reshardable", "parallel"] = Field(
        "reshardable", description="the distributed optimizer's state on disk. reshardable: gathered on each "
        "tensor/pipeline shard's data-parallel rank 0, which writes it; loads into any TP/PP/CP/DP layout. "
        "parallel: every rank writes its own part, no gather; loads only into the saving run's TP/PP/CP layout, "
        "transformer_impl and bucketing (the data-parallel size may change); see docs/pretraining.md")

    _expand_home = field_validator("load", mode="before")(expand_home)


class WandbFields(BaseModel):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (pre-training and adaptation)."""
    wandb_project: Optional[str] = Field(None, description="also log to this W&B project (pip install wandb; "
                                         "WANDB_MODE=offline where nodes have no internet, then `wandb sync`)")
    wandb_entity: Optional[str] = Field(None, description="W&B team or user; default: the logged-in user's")
    wandb_run_name: Optional[str] = Field(None, description="default: the output_dir's name")


class LoggingConfig(Section, WandbFields):
    log_interval: int = Field(1, ge=1)
    peak_tflops: Optional[float] = Field(None, gt=0, description="per-device peak for MFU; default: known GPUs' "
                                         "dense bf16 peak, none on CPU")
    tensorboard: bool = True
    profile_iterations: Optional[tuple[int, int]] = Field(
        None, description="[first, last]: a torch.profiler trace of these iterations (1-based, inclusive, as "
        "logged) per profiling rank in <output_dir>/profile/ (Chrome/Perfetto JSON and an op table)")
    profile_ranks: list[int] = Field(default_factory=lambda: [0], description="global ranks that profile")
    profile_memory: bool = Field(False, description="with profile_iterations on CUDA: also a CUDA memory "
                                 "snapshot of the same iterations (open it at pytorch.org/memory_viz)")


class Config(Section):
    output_dir: str = "runs/default"
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    _expand_home = field_validator("output_dir", mode="before")(expand_home)
