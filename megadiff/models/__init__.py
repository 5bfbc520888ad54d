"""Models: the attention variants as megatron-core layers, built from the config tree."""
from megadiff.models.builder import build_model, build_model_chunk
from megadiff.models.transformer_config import MegadiffTransformerConfig, to_transformer_config

__all__ = ["MegadiffTransformerConfig", "build_model", "build_model_chunk", "to_transformer_config"]
