"""megadiff: differential-attention language models on megatron-core."""
__version__ = "0.1.0"
