#!/usr/bin/env python
"""Tokenize text into a megatron indexed dataset: the same as `megadiff prepare-data`.

    python tools/preprocess_data.py CONFIG [key=value ...]
    python tools/preprocess_data.py configs/diff-3b.yaml 'data.sources=[corpus/*.jsonl]' \\
        data.prefix=data/prepared/corpus data.workers=16

Writes <data.prefix>.bin/.idx (one document per sequence, EOD after each) and a manifest;
running it again with unchanged sources and tokenizer does nothing. See docs/data.md.
"""
import sys

from megadiff.cli import entry_point as megadiff_main, run_in_utf8_mode

if __name__ == "__main__":
    run_in_utf8_mode()
    sys.exit(megadiff_main(["prepare-data", *sys.argv[1:]]))
