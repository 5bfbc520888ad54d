#!/usr/bin/env python
"""Convert checkpoints between megadiff and Hugging Face: the same as `megadiff convert`.

    python tools/convert_checkpoint.py to-hf   --load runs/x --save hf/x [--dtype bf16] [--no-check] [--remote-code]
    python tools/convert_checkpoint.py from-hf --load hf/x --save checkpoints/x [--dtype bf16] [--no-check]

--load of to-hf takes a run's output_dir, its checkpoints/ directory (latest iteration) or an
iter_* directory, saved with any tensor/pipeline-parallel layout. See docs/conversion.md.
"""
import sys

from megadiff.cli import entry_point as megadiff_main, run_in_utf8_mode

if __name__ == "__main__":
    run_in_utf8_mode()
    sys.exit(megadiff_main(["convert", *sys.argv[1:]]))
