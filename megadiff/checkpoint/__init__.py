"""Checkpoints: megatron dist_checkpointing save/load, resume, full-tensor gathering."""
