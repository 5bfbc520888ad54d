"""Checkpoints (weights drawn, trained on nothing) whose configs name prepared KJV data: what the
commands that read a checkpoint's held-out split (evaluate, outliers, needles) are tested on."""
from __future__ import annotations

import json
from pathlib import Path

from megadiff.checkpoint.format import CHECKPOINTS_DIR, LATEST_FILE, iteration_dir
from megadiff.config import Config, build_config
from megadiff.data.prepare import prepare
from tests.conftest import kjv_verses
from tests.convert_worker import build_tokenizer, save_in_process, variant_config


def write_documents(path: Path, first_verse: int = 0) -> None:
    """80 documents of 20 KJV verses each, from `first_verse` on."""
    verses = kjv_verses()[first_verse:first_verse + 1600]
    path.write_text("".join(json.dumps({"text": " ".join(verses[i:i + 20])}) + "\n" for i in range(0, 1600, 20)))


def prepared_data(root: Path) -> list[str]:
    """data.* overrides naming KJV documents prepared under `root` (80/20 train/valid)."""
    tokenizer = root / "tokenizer"
    if not tokenizer.exists():
        build_tokenizer(tokenizer)
    write_documents(root / "docs.jsonl")
    data = [f"data.sources=[{root / 'docs.jsonl'}]", f"data.prefix={root / 'prepared' / 'docs'}",
            f"data.cache_dir={root / 'cache'}", "data.split=80,20,0", f"data.tokenizer={tokenizer}"]
    prepare(build_config({}, data).data)
    return data


def held_out_run(root: Path, variant: str, iteration: int = 1, overrides: tuple[str, ...] = ()) -> tuple[Path, Config]:
    """(run directory, its config, with `overrides`): a single-process checkpoint of `variant` reading the data above."""
    data = prepared_data(root)
    cfg = build_config(variant_config(variant, "single", str(root / "tokenizer")).model_dump(mode="json"),
                       data + list(overrides))
    output_dir = root / variant
    save_in_process(cfg, iteration_dir(output_dir / CHECKPOINTS_DIR, iteration))
    (output_dir / CHECKPOINTS_DIR / LATEST_FILE).write_text(str(iteration))
    return output_dir, cfg
