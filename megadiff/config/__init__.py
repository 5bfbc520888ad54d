from megadiff.config.loader import build_config, dump_config, load_config
from megadiff.config.schema import (
    DIFFERENTIAL_VARIANTS, CheckpointConfig, Config, DataConfig, LoggingConfig, ModelConfig, ParallelConfig,
    TrainConfig, WandbFields,
)
from megadiff.config.validate import (
    ConfigError, data_parallel_size, lr_decay_length, micro_batches_per_step, padded_vocab_size, qkv_widths,
    refuse_a_file_for_directory, resolved_architecture, resolved_ffn_hidden_size, resolved_head_dim,
    resolved_head_norm, resolved_kv_heads, short_warmup_warning, validate_config, validate_model, validate_parallel,
    validate_wandb,
)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DIFFERENTIAL_VARIANTS", "DataConfig", "LoggingConfig",
    "ModelConfig", "ParallelConfig", "TrainConfig", "WandbFields", "build_config", "data_parallel_size", "dump_config",
    "load_config", "lr_decay_length", "micro_batches_per_step", "padded_vocab_size", "qkv_widths",
    "refuse_a_file_for_directory", "resolved_architecture", "resolved_ffn_hidden_size", "resolved_head_dim",
    "resolved_head_norm", "resolved_kv_heads", "short_warmup_warning", "validate_config", "validate_model",
    "validate_parallel", "validate_wandb",
]
