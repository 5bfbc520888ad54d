"""Hugging Face <-> megadiff conversion (see docs/conversion.md).

DIFF -> stock DiffLlama, softmax -> stock Llama, Shared DIFF / DINT -> megadiff's own
modeling code shipped in the export directory (trust_remote_code=True); and back.
"""
from megadiff.convert.from_hf import convert_from_hf
from megadiff.convert.hf_layout import ConversionError
from megadiff.convert.to_hf import convert_to_hf

__all__ = ["ConversionError", "convert_from_hf", "convert_to_hf"]
