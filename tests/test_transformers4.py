"""Exports load in transformers 4.x too, which evaluation stacks still pin: the stock ones (DiffLlama, Llama),
tokenizer included, and the adapted ones (Dex, DAA) give the token ids, logits and greedy tokens transformers 5
gives, and so do megadiff's remote-code exports (DINT, Shared DIFF, DIFF), in one sequence and in a left-padded
batch. transformers 4.57 runs in a subprocess, from the directory `make test` installs it in."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from transformers import AutoTokenizer

from megadiff.adapt.export import save_adapted
from megadiff.config import build_config
from megadiff.convert import convert_to_hf
from tests.convert_worker import MODEL, VARIANTS, build_tokenizer, save_in_process
from tests.test_adapt import VARIANTS as ADAPTATIONS
from tests.test_adapt import tiny_model, tokens

TRANSFORMERS4 = Path(__file__).resolve().parents[1] / ".venv" / "transformers4"
TEXT = "Hello world, 2024! And the earth was without form."
NEW_TOKENS = 6
# a base model's RoPE as Llama 3.2's (base 500,000, llama3 scaling) and Qwen2's (base 1,000,000) have it, scaled from
# 32 positions so that the scaling changes these tiny models' low frequencies
LLAMA3_ROPE = {"rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 32}}
# each export's tokenizer's ids of TEXT (if it has one), the logits of the ids given (or those), the greedy
# tokens of a left-padded batch of them, and a beam search's sequences and scores (the cache reordered as beams swap)
READ = """
import json, os, sys
import torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
assert transformers.__version__.startswith("{version}"), transformers.__version__
out = {{}}
for directory, ids in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    text_ids = AutoTokenizer.from_pretrained(directory, trust_remote_code=True)({text!r}).input_ids \
        if os.path.exists(os.path.join(directory, "tokenizer_config.json")) else None
    ids = torch.tensor([text_ids if ids is None else ids])
    # the same ids and a shorter copy, left-padded to one batch
    batch = torch.cat([ids, torch.cat([torch.zeros_like(ids[:, :3]), ids[:, 3:]], dim=1)])
    mask = torch.ones_like(batch)
    mask[1, :3] = 0
    with torch.no_grad():
        logits = model(ids).logits[0]
        new = model.generate(batch, attention_mask=mask, max_new_tokens={new_tokens}, do_sample=False,
                             pad_token_id=0)[:, ids.shape[1]:]
        beams = model.generate(ids, max_new_tokens={beam_tokens}, num_beams=3, num_return_sequences=3,
                               do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    out[directory] = {{"text_ids": text_ids, "ids": ids[0].tolist(), "logits": logits.tolist(), "new": new.tolist(),
                      "beams": beams.sequences[:, ids.shape[1]:].tolist(),
                      "beam_scores": beams.sequences_scores.tolist()}}
print(json.dumps(out))
"""


def read_by(version: str, exports: dict[Path, list[int] | None], pythonpath: str | None = None) -> dict:
    # the beams run long enough to swap rows of differing histories (DINT's running sums then differ)
    script = READ.format(version=version, text=TEXT, new_tokens=NEW_TOKENS, beam_tokens=2 * NEW_TOKENS)
    return run_on_exports(script, exports, pythonpath)


def run_on_exports(script: str, exports: dict[Path, list[int] | None], pythonpath: str | None = None) -> dict:
    """The JSON `script` prints last, given the exports and their ids as its argument."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    done = subprocess.run([sys.executable, "-c", script, json.dumps({str(path): ids for path, ids in exports.items()})],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def exported(root: Path, name: str, variant: str, tokenizer: str, vocab_size: int, remote_code: bool = False,
             settings: tuple[str, ...] = ()) -> Path:
    vocabulary = [f"data.tokenizer={tokenizer}", f"model.vocab_size={vocab_size}"]  # the later overrides MODEL's
    cfg = build_config({}, MODEL + VARIANTS[variant] + vocabulary + list(settings))
    save_in_process(cfg, root / name / "checkpoint")
    return convert_to_hf(root / name / "checkpoint", root / name / "hf", remote_code=remote_code)


def adapted(root: Path, name: str, arch: str, tokenizer=None, **settings) -> Path:
    apply, config = ADAPTATIONS[name]
    model = apply(tiny_model(arch, init=0.2, **settings), config, calibration=[tokens(seed=5)])
    return save_adapted(model, root / f"{name}_{arch}", tokenizer=tokenizer)


def skip_without_transformers4() -> None:
    if not (TRANSFORMERS4 / "transformers").is_dir():
        pytest.skip(f"transformers 4.x is not installed in {TRANSFORMERS4} (make test installs it)")


def test_exports_read_in_transformers4_as_in_transformers5(tmp_path):
    skip_without_transformers4()
    small = str(build_tokenizer(tmp_path / "tokenizer"))
    ids = tokens(batch=1, seed=3)[0].tolist()
    exports = {exported(tmp_path, "diff", "diff", small, 300): None,
               exported(tmp_path, "softmax", "softmax", small, 300): None,
               exported(tmp_path, "diff_cl100k", "diff", "cl100k_base", 100277): None,
               adapted(tmp_path, "dex-entropy", "llama", **LLAMA3_ROPE): ids,
               adapted(tmp_path, "daa", "qwen2", AutoTokenizer.from_pretrained(small), rope_theta=1e6): ids,
               adapted(tmp_path, "diff_v", "mistral"): ids,
               # ids whose beams swap rows of differing histories: a running sum left unreordered shows
               exported(tmp_path, "dint", "dint", small, 300, remote_code=True): [5, 17, 42, 99, 7, 12, 250],
               exported(tmp_path, "shared_diff", "shared_diff", small, 300, remote_code=True): None,
               exported(tmp_path, "diff_remote", "diff", small, 300, remote_code=True): None}
    theirs = read_by("4.", exports, str(TRANSFORMERS4))
    ours = read_by("5.", exports)
    for directory in exports:
        read, expected = theirs[str(directory)], ours[str(directory)]
        assert read["text_ids"] == expected["text_ids"] and read["ids"] == expected["ids"], directory
        torch.testing.assert_close(torch.tensor(read["logits"]), torch.tensor(expected["logits"]), rtol=1e-4,
                                   atol=1e-4)
        assert read["new"] == expected["new"] and read["beams"] == expected["beams"], directory
        torch.testing.assert_close(torch.tensor(read["beam_scores"]), torch.tensor(expected["beam_scores"]),
                                   rtol=1e-4, atol=1e-4)


def test_exports_of_a_llama3_scaled_model_read_in_transformers4_as_in_transformers5(tmp_path):
    """transformers 4.x reads RoPE scaling from config.json's rope_scaling alone, which transformers 5 does not write:
    a converted Llama 3.1 exported back ran there with unscaled RoPE."""
    skip_without_transformers4()
    small = str(build_tokenizer(tmp_path / "tokenizer"))
    # LLAMA3_ROPE's (the other keys at their defaults, Llama 3.1's)
    settings = ("model.rope_theta=500000", "model.rope_scaling.factor=4",
                "model.rope_scaling.original_max_position_embeddings=32")
    exports = {exported(tmp_path, variant, variant, small, 300, remote_code, settings): None
               for variant, remote_code in (("softmax", False), ("diff", False), ("dint", True))}
    theirs, ours = read_by("4.", exports, str(TRANSFORMERS4)), read_by("5.", exports)
    for directory in exports:
        torch.testing.assert_close(torch.tensor(theirs[str(directory)]["logits"]),
                                   torch.tensor(ours[str(directory)]["logits"]), rtol=1e-4, atol=1e-4)


# greedy tokens with transformers 4's static cache and without any cache (every step recomputes the whole sequence)
STATIC_CACHE = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM
assert transformers.__version__.startswith("4."), transformers.__version__
out = {}
for directory, ids in json.loads(sys.argv[1]).items():
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    ids = torch.tensor([ids])
    with torch.no_grad():
        out[directory] = {cache: model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
                                                **settings)[0, ids.shape[1]:].tolist()
                          for cache, settings in (("static", {"cache_implementation": "static"}),
                                                  ("none", {"use_cache": False}))}
print(json.dumps(out))
"""


def test_adapted_exports_decode_with_transformers4s_static_cache_as_without_a_cache(tmp_path):
    """4.x's static cache writes each step's keys and values at the cache_position the attention passes it;
    given none, it wrote every step over the first positions and the adapted models decoded other tokens. It sizes
    its values by the keys: diff_k's two key maps, side by side in the key entry, made the values too wide to
    write (a RuntimeError)."""
    skip_without_transformers4()
    ids = tokens(batch=1, seed=3)[0].tolist()
    exports = {adapted(tmp_path, name, arch): ids
               for name, arch in (("dex-entropy", "llama"), ("daa", "qwen2"), ("diff_v", "mistral"),
                                  ("diff_k", "llama"), ("diff_k", "mistral"))}
    for directory, decoded in run_on_exports(STATIC_CACHE, exports, str(TRANSFORMERS4)).items():
        assert decoded["static"] == decoded["none"], directory


# what generate() does with each static cache implementation: the error it raises, or "generated"
STATIC_IMPLEMENTATIONS = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
assert transformers.__version__.startswith("{version}"), transformers.__version__
out = {{}}
for directory in json.loads(sys.argv[1]):
    model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
    out[directory] = {{}}
    for implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS:
        try:
            model.generate(torch.tensor([[5, 17, 42]]), max_new_tokens=2, do_sample=False, pad_token_id=0,
                           cache_implementation=implementation)
            out[directory][implementation] = "generated"
        except Exception as error:
            out[directory][implementation] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(out))
"""


def test_remote_code_exports_refuse_transformers4s_static_caches_as_transformers5_does(tmp_path):
    """Every remote-code variant refuses a static cache in generate() with megadiff's own message in 4.x, as in 5.x;
    4.x failed building DINT's (KeyError 'hybrid': no static layer for its layer type) and, on its deprecated
    "hybrid" name, every variant's (AttributeError), before the model could say that it takes a dynamic cache."""
    skip_without_transformers4()
    small = str(build_tokenizer(tmp_path / "tokenizer"))
    exports = {exported(tmp_path, variant, variant, small, 300, remote_code=True): None
               for variant in ("dint", "shared_diff", "diff")}
    theirs = run_on_exports(STATIC_IMPLEMENTATIONS.format(version="4."), exports, str(TRANSFORMERS4))
    ours = run_on_exports(STATIC_IMPLEMENTATIONS.format(version="5."), exports)
    for directory in exports:
        refusal = ours[str(directory)]["static"]
        assert refusal.startswith("ValueError: ") and "dynamic cache" in refusal, refusal
        assert set(theirs[str(directory)].values()) == {refusal}, (directory, theirs[str(directory)])


# a DINT export's cache after a prompt, put through each of the Cache API's row operations (as beam search, contrastive
# search and user code call them), then one more token: the logits' largest difference from the uncached forward of
# the rows the cache then holds; and what a crop of a position gives
CACHE_OPERATIONS = """
import json, sys
import torch, transformers
from transformers import AutoModelForCausalLM
assert transformers.__version__.startswith("{version}"), transformers.__version__
(directory, ids), = json.loads(sys.argv[1]).items()
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)
ids = torch.tensor(ids)
swap, second, doubled = torch.tensor([1, 0]), torch.tensor([1]), torch.tensor([0, 0, 1, 1])
operations = {{"reorder_cache": (lambda cache: cache.reorder_cache(swap), swap),
              "batch_select_indices": (lambda cache: cache.batch_select_indices(swap), swap),
              "batch_select_indices of one row": (lambda cache: cache.batch_select_indices(second), second),
              "batch_repeat_interleave": (lambda cache: cache.batch_repeat_interleave(2), doubled)}}
operations["crop"] = (lambda cache: cache.crop(-1), None)


def decoded_on(operation, rows):
    cache = model(ids[:, :-1], use_cache=True).past_key_values
    try:
        operation(cache)
        if rows is None:
            return "cropped"
        cached = model(ids[rows, -1:], past_key_values=cache).logits[:, -1]
    except Exception as error:
        return f"{{type(error).__name__}}: {{error}}"
    return (cached - model(ids[rows], use_cache=False).logits[:, -1]).abs().max().item()


with torch.no_grad():
    print(json.dumps({{name: decoded_on(*operation) for name, operation in operations.items()}}))
"""


@pytest.mark.parametrize("version", ["4.", "5."])
def test_dint_caches_row_operations_keep_each_rows_running_sum_and_a_crop_is_refused(tmp_path, version):
    """A DINT cache's rows selected, swapped or repeated decode on as the uncached forward of those rows: the
    operations moved the keys and values but not the running sum (4.x's reorder_cache and batch_select_indices,
    5.x's batch_select_indices, silently wrong; the others failing on the sum's batch size). A crop, which cannot
    take positions out of the sum, is refused as such (4.x decoded on with the dropped token still in the sum;
    5.x said to call activate_past_recording)."""
    if version == "4.":
        skip_without_transformers4()
    small = str(build_tokenizer(tmp_path / "tokenizer"))
    ids = tokens(batch=2, seed=3)[:, :9].tolist()
    exports = {exported(tmp_path, "dint", "dint", small, 300, remote_code=True): ids}
    read = run_on_exports(CACHE_OPERATIONS.format(version=version), exports,
                          str(TRANSFORMERS4) if version == "4." else None)
    crop = read.pop("crop")
    for operation, difference in read.items():
        assert isinstance(difference, float) and difference < 1e-5, (operation, difference)
    assert crop.startswith("ValueError: ") and "running sum" in crop, crop
