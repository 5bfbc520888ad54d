"""Inference: a checkpoint of any layout as one module in one process, text generation, held-out evaluation."""
from megadiff.inference.loader import CausalLM, load_checkpoint

__all__ = ["CausalLM", "load_checkpoint"]
