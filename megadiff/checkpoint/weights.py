"""Model-only save/load in the run checkpoint format (conversion, inference, initial loads)."""
from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing

from megadiff.checkpoint.format import CONFIG_FILE, model_keys, model_sharded_state
from megadiff.config import Config, dump_config


def load_model_weights(chunks: list, checkpoint_dir: str | Path, strict: bool = True) -> None:
    """Load a checkpoint's model weights into unwrapped GPTModel chunks of any TP/PP layout."""
    state = dist_checkpointing.load(model_sharded_state(chunks), str(checkpoint_dir))
    for key, chunk in zip(model_keys(len(chunks)), chunks):
        chunk.load_state_dict(state[key], strict=strict)


def save_model_weights(chunks: list, cfg: Config, checkpoint_dir: str | Path) -> None:
    """Write a model-only checkpoint (no optimizer), e.g. after converting from Hugging Face."""
    checkpoint_dir = Path(checkpoint_dir)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state(chunks), str(checkpoint_dir))
    if not dist.is_initialized() or dist.get_rank() == 0:
        dump_config(cfg, checkpoint_dir / CONFIG_FILE)
