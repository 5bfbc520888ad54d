"""Inference: a checkpoint of any layout as one module in one process, text generation, held-out evaluation."""
from megadiff.checkpoint.single_process import CausalLM, load_checkpoint

__all__ = ["CausalLM", "load_checkpoint"]
