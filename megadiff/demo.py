"""`megadiff demo`: the main job end to end on CPU, on the embedded default config.

Each stage runs as its own `megadiff` process, exactly what a user would type:
prepare + pre-train a tiny DIFF model on the bundled corpus, convert the
checkpoint to Hugging Face (stock DiffLlama), then sample from the HF model.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from megadiff.config.bundled import BUNDLED_CONFIGS

DEMO_CONFIG = BUNDLED_CONFIGS / "demo" / "diff-tiny.yaml"
PROMPT = "In the beginning God"


def _run(stage: str, *args: str) -> int:
    command = [sys.executable, "-m", "megadiff", *args]
    print(f"\n==> {stage}: {' '.join(command[2:])}", flush=True)
    started = time.time()
    code = subprocess.run(command).returncode
    print(f"==> {stage} {'done' if code == 0 else f'failed (exit code {code})'} in {time.time() - started:.0f} s",
          flush=True)
    return code


def sample_from_hf(hf_dir: Path, prompt: str = PROMPT, max_new_tokens: int = 40, seed: int = 0) -> str:
    """A seeded top-k sample: a model this small repeats itself under greedy decoding."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # a variant other than DIFF (model.variant=dint among the overrides) exports megadiff's own modeling code beside
    # the weights, which transformers runs only when trusted: the conversion just wrote it from megadiff's package
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    torch.manual_seed(seed)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, temperature=0.8, top_k=40)
    return tokenizer.decode(output[0], skip_special_tokens=True)


def run_demo(output_dir: str = "runs/demo", overrides: list[str] = ()) -> int:
    """Stops at the first stage that fails, with its exit code. An output_dir among the overrides wins."""
    from megadiff.config import load_config

    # read (and checked) before any stage: the conversion must find the run where the overrides put it
    out = Path(load_config(DEMO_CONFIG, [f"output_dir={output_dir}", *overrides]).output_dir)
    code = _run("pre-train", "pretrain", str(DEMO_CONFIG), f"output_dir={output_dir}", *overrides)
    hf_dir = out / "hf"
    code = code or _run("convert to Hugging Face", "convert", "to-hf", "--load", str(out), "--save", str(hf_dir))
    if code:
        return code
    print(f"\n==> a sample from the Hugging Face model in {hf_dir} (temperature 0.8, top-k 40):")
    print(sample_from_hf(hf_dir))
    print(f"\nTensorBoard logs: {out / 'tensorboard'}  metrics: {out / 'metrics.jsonl'}  HF model: {hf_dir}")
    return 0
