"""Build the GPT model (one chunk per virtual pipeline stage) from megadiff's config."""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

from megadiff.config import Config, padded_vocab_size
from megadiff.config.schema import RopeScalingConfig
from megadiff.models.specs import block_spec
from megadiff.models.transformer_config import MegadiffTransformerConfig, to_transformer_config


def build_model_chunk(cfg: Config, config: MegadiffTransformerConfig, pre_process: bool, post_process: bool,
                      vp_stage: int | None = None) -> GPTModel:
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, vp_stage),
        vocab_size=padded_vocab_size(cfg.model, cfg.parallel.tensor),
        max_sequence_length=cfg.model.seq_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=cfg.model.tie_embeddings,
        position_embedding_type="rope",
        rotary_base=int(cfg.model.rope_theta),
        vp_stage=vp_stage,
    )
    if cfg.model.rope_scaling is not None:
        scale_rotary_frequencies(model.rotary_pos_emb, cfg.model.rope_scaling)
    return model


def scale_rotary_frequencies(rotary, scaling: RopeScalingConfig) -> None:
    """Llama 3's scaling of a megatron RotaryEmbedding's frequencies, before any forward pass caches them. Its
    constructor's rope_scaling takes the factor alone (low_freq_factor 1, high_freq_factor 4 and 8192 original
    positions hard-coded); the method it calls takes all four."""
    rotary.inv_freq = rotary._apply_scaling(
        rotary.inv_freq, factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
        high_freq_factor=scaling.high_freq_factor,
        original_max_position_embeddings=scaling.original_max_position_embeddings)


def build_model(cfg: Config, config: MegadiffTransformerConfig | None = None) -> list[GPTModel]:
    """This rank's model chunks (more than one under the interleaved pipeline schedule), on the
    device megatron computes on.

    Model-parallel groups must be initialised (megadiff.parallel.initialize).
    """
    config = config or to_transformer_config(cfg)
    virtual = cfg.parallel.virtual_pipeline or 1
    chunks = []
    for vp_stage in range(virtual):
        stage = vp_stage if cfg.parallel.virtual_pipeline else None
        chunks.append(build_model_chunk(
            cfg, config,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            vp_stage=stage))
    if not config.use_cpu_initialization:
        # megatron's layers allocate on the current CUDA device, megadiff's own parameters (lambda,
        # norms, low-rank factors) on the CPU: one move, as megatron's training loop does
        device = torch.cuda.current_device()
        chunks = [chunk.to(device) for chunk in chunks]
    return chunks
