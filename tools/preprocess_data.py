#!/usr/bin/env python
"""Tokenize text into a megatron indexed dataset: the same as `megadiff prepare-data`.

    python tools/preprocess_data.py CONFIG [key=value ...]
    python tools/preprocess_data.py configs/x.yaml data.sources=[corpus.jsonl] data.prefix=data/prepared/x data.workers=8
"""
import argparse
import sys

from megadiff.config import ConfigError
from megadiff.data.prepare import prepare_from_config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="YAML config file (its data section is used)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    args = parser.parse_args()
    try:
        return prepare_from_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"preprocess_data: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
