"""The stock exports (DiffLlama, Llama) load in transformers 4.x too, which evaluation stacks still pin:
its tokenizer and model give the ids, logits and greedy tokens transformers 5 gives. Remote-code exports
need 5.x and say so. transformers 4.57 runs in a subprocess from the directory `make test` installs it in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megadiff.config import build_config
from megadiff.convert import convert_to_hf
from tests.convert_worker import MODEL, VARIANTS, build_tokenizer, save_in_process

TRANSFORMERS4 = Path(__file__).resolve().parents[1] / ".venv" / "transformers4"
TEXT = "Hello world, 2024! And the earth was without form."
NEW_TOKENS = 6
# what each export gives in transformers 4.x, printed as JSON
READ_IN_TRANSFORMERS4 = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
assert transformers.__version__.startswith("4."), transformers.__version__
out = {}
for directory in sys.argv[1:]:
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
        model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    except ImportError as error:
        out[directory] = {"error": str(error)}
        continue
    inputs = tokenizer(TEXT, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0]
        new = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs.input_ids.shape[1]:]
    out[directory] = {"ids": inputs.input_ids[0].tolist(), "logits": logits.tolist(), "new": new.tolist()}
print(json.dumps(out))
"""


def exported(root: Path, name: str, variant: str, tokenizer: str, vocab_size: int, remote_code: bool = False) -> Path:
    model = [arg for arg in MODEL if not arg.startswith("model.vocab_size=")] + [f"model.vocab_size={vocab_size}"]
    cfg = build_config({}, model + VARIANTS[variant] + [f"data.tokenizer={tokenizer}"])
    save_in_process(cfg, root / name / "checkpoint")
    return convert_to_hf(root / name / "checkpoint", root / name / "hf", remote_code=remote_code)


def in_transformers4(directories: list[Path]) -> dict:
    script = f"TEXT = {TEXT!r}\nNEW_TOKENS = {NEW_TOKENS}\n" + READ_IN_TRANSFORMERS4
    env = {**os.environ, "PYTHONPATH": str(TRANSFORMERS4), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, *map(str, directories)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_stock_exports_read_in_transformers4_as_in_transformers5(tmp_path):
    if not (TRANSFORMERS4 / "transformers").is_dir():
        pytest.skip(f"transformers 4.x is not installed in {TRANSFORMERS4} (make test installs it)")
    small = str(build_tokenizer(tmp_path / "tokenizer"))
    stock = [exported(tmp_path, "diff", "diff", small, 300), exported(tmp_path, "softmax", "softmax", small, 300),
             exported(tmp_path, "diff_cl100k", "diff", "cl100k_base", 100277)]
    remote = exported(tmp_path, "dint", "dint", small, 300, remote_code=True)
    theirs = in_transformers4([*stock, remote])
    for directory in stock:
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory)
        inputs = tokenizer(TEXT, return_tensors="pt")
        with torch.no_grad():
            logits = model(**inputs).logits[0]
            new = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0, inputs.input_ids.shape[1]:]
        read = theirs[str(directory)]
        assert read["ids"] == inputs.input_ids[0].tolist(), directory
        torch.testing.assert_close(torch.tensor(read["logits"]), logits, rtol=1e-4, atol=1e-4)
        assert read["new"] == new.tolist(), directory
    assert "needs transformers >= 5.0" in theirs[str(remote)]["error"]
