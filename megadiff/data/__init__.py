"""Data: tokenizers, the bundled corpus, prepare-data (text -> megatron indexed dataset), training datasets."""
