"""generate() on the Hugging Face exports: the remote-code models' KV cache (and DINT's running
sum in it) gives the tokens of cache-free generation, left-padded batches the tokens of single
prompts, and every export generates what megadiff's own (cache-free) generation gives."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from megadiff.convert import convert_to_hf
from megadiff.inference import load_checkpoint
from megadiff.inference.generate import generate
from tests.convert_worker import build_tokenizer, save_in_process, variant_config

NEW_TOKENS = 8
PROMPT = [5, 17, 42, 99, 7]
EXPORTS = {  # name: (variant, export with megadiff's modeling code)
    "softmax": ("softmax", False), "diff": ("diff", False), "diff_remote_code": ("diff", True),
    "dint": ("dint", True), "shared_diff": ("shared_diff", True),
}
REMOTE = [name for name, (_, remote) in EXPORTS.items() if remote]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (megadiff checkpoint dir, HF export dir, HF model)."""
    root = tmp_path_factory.mktemp("generate")
    tokenizer = str(build_tokenizer(root / "tokenizer"))
    out = {}
    for name, (variant, remote_code) in EXPORTS.items():
        checkpoint = root / name / "checkpoint"
        save_in_process(variant_config(variant, "single", tokenizer), checkpoint)
        hf_dir = convert_to_hf(checkpoint, root / name / "hf", remote_code=remote_code)
        out[name] = checkpoint, hf_dir, AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=remote_code)
    return out


def hf_greedy(model, input_ids, attention_mask=None, use_cache=True) -> torch.Tensor:
    with torch.no_grad():
        output = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS,
                                do_sample=False, use_cache=use_cache, pad_token_id=0)
    return output[:, input_ids.shape[1]:]


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_generates_what_megadiff_generates(models, name):
    checkpoint, _, model = models[name]
    eod = model.generation_config.eos_token_id
    # every id, as transformers may draw the padded vocabulary's (megadiff leaves them out by default)
    ours = generate(load_checkpoint(checkpoint), PROMPT, max_new_tokens=NEW_TOKENS, stop_ids=[eod],
                    decodable=torch.ones(model.config.vocab_size, dtype=torch.bool))
    theirs = hf_greedy(model, torch.tensor([PROMPT]))[0].tolist()
    assert theirs[:len(ours)] == ours


@pytest.mark.parametrize("name", ["diff", *REMOTE])
def test_the_demos_sample_is_transformers_sample_of_any_variants_export(models, name):
    """`megadiff demo` takes any override of its config, model.variant=dint too: its last stage samples from the
    export, which then holds megadiff's modeling code, as a user loading it with trust_remote_code would."""
    from megadiff.demo import sample_from_hf

    _, hf_dir, model = models[name]
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, trust_remote_code=True)
    prompt = "In the beginning God"
    torch.manual_seed(0)
    with torch.no_grad():
        expected = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=NEW_TOKENS, do_sample=True,
                                  temperature=0.8, top_k=40)
    assert sample_from_hf(hf_dir, prompt, max_new_tokens=NEW_TOKENS) == tokenizer.decode(expected[0],
                                                                                         skip_special_tokens=True)


def test_a_plain_prompt_is_read_as_the_tokenizer_reads_a_text(tmp_path, capsys):
    """With a tokenizer that puts a BOS before every text (Llama's), `megadiff generate` continues the
    prompt as transformers does the export's tokenizer's encoding of it, BOS first; files of prompts
    alike."""
    from megadiff.cli import main

    tokenizer = str(build_tokenizer(tmp_path / "tokenizer", bos="<s>", adds_bos=True))
    checkpoint = tmp_path / "checkpoint"
    save_in_process(variant_config("diff", "single", tokenizer), checkpoint)
    hf_dir = convert_to_hf(checkpoint, tmp_path / "hf")
    hf_tokenizer, model = AutoTokenizer.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir)
    prompt = "In the beginning God"
    input_ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert input_ids[0, 0] == hf_tokenizer.bos_token_id
    padded = model.config.vocab_size  # megadiff never generates the embedding's padding ids: nor does the oracle
    with torch.no_grad():
        new = model.generate(input_ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             suppress_tokens=list(range(len(hf_tokenizer), padded)))[0, input_ids.shape[1]:].tolist()
    expected = hf_tokenizer.decode(new[:new.index(0)] if 0 in new else new)
    capsys.readouterr()
    assert main(["generate", "--load", str(checkpoint), "--prompt", prompt, "--max-new-tokens", str(NEW_TOKENS),
                 "--dtype", "fp32"]) == 0
    assert capsys.readouterr().out == prompt + expected + "\n"
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": prompt}) + "\n")
    assert main(["generate", "--load", str(checkpoint), "--prompts", str(tmp_path / "prompts.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), "--max-new-tokens", str(NEW_TOKENS), "--dtype", "fp32"]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text())["completion"] == expected


@pytest.mark.parametrize("name", REMOTE)
def test_remote_code_cache_gives_the_tokens_of_full_recomputation(models, name):
    model = models[name][2]
    prompt = torch.tensor([PROMPT, [3, 1, 4, 1, 5]])
    assert torch.equal(hf_greedy(model, prompt, use_cache=True), hf_greedy(model, prompt, use_cache=False))
    with torch.no_grad():  # one decoding step against the cache vs the whole sequence at once
        full = model(input_ids=prompt).logits[:, -1]
        prefill = model(input_ids=prompt[:, :-1], use_cache=True)
        step = model(input_ids=prompt[:, -1:], past_key_values=prefill.past_key_values).logits[:, -1]
        # several new tokens after cached ones: the one causal mask that is built without padding
        start = model(input_ids=prompt[:, :2], use_cache=True)
        rest = model(input_ids=prompt[:, 2:], past_key_values=start.past_key_values).logits
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rest, model(input_ids=prompt).logits[:, 2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", REMOTE)
def test_remote_code_exports_load_as_a_base_model_too(models, name):
    """AutoModel (feature extraction, a custom head) gives the causal LM's last hidden states; it refused the
    remote-code exports as an unrecognized configuration."""
    from transformers import AutoModel

    _, hf_dir, causal_lm = models[name]
    base = AutoModel.from_pretrained(hf_dir, trust_remote_code=True).eval()
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(base(input_ids=prompt).last_hidden_state,
                                   causal_lm(input_ids=prompt, output_hidden_states=True).hidden_states[-1])
    assert AutoTokenizer.from_pretrained(hf_dir).model_max_length == causal_lm.config.max_position_embeddings


@pytest.mark.parametrize("name", REMOTE)
def test_remote_code_builds_no_mask_without_padding_and_refuses_a_static_cache(models, name, monkeypatch):
    """A [B, 1, N, N] mask is 4 GiB of booleans per 64K sequence, and keeps SDPA off its flash kernel."""
    model = models[name][2]
    modeling = __import__(type(model).__module__, fromlist=["attention_mask_4d"])

    def no_mask(*args):
        raise AssertionError("a mask was built for a batch without padding")

    monkeypatch.setattr(modeling, "attention_mask_4d", no_mask)
    masks_seen = []  # what the layers are given: a mask of ones is dropped once, not checked (a GPU sync) per layer
    seeing = modeling.sdpa_masking
    monkeypatch.setattr(modeling, "sdpa_masking", lambda mask, *args: masks_seen.append(mask) or seeing(mask, *args))
    with torch.no_grad():
        prefill = model(input_ids=torch.tensor([PROMPT]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                        use_cache=True)
        model(input_ids=torch.tensor([[3]]), past_key_values=prefill.past_key_values)
    assert len(masks_seen) == 2 * model.config.num_hidden_layers and not any(m is not None for m in masks_seen)
    with pytest.raises(ValueError, match="not a static one"):
        model.generate(torch.tensor([PROMPT]), max_new_tokens=2, cache_implementation="static", pad_token_id=0)


@pytest.mark.parametrize("name", REMOTE)
def test_left_padded_batch_generates_like_single_prompts(models, name):
    model = models[name][2]
    short = [11, 12, 13]
    batch = torch.tensor([PROMPT, [0, 0] + short])
    mask = torch.tensor([[1] * 5, [0, 0, 1, 1, 1]])
    together = hf_greedy(model, batch, attention_mask=mask)
    for row, prompt in enumerate((PROMPT, short)):
        alone = hf_greedy(model, torch.tensor([prompt]))[0]
        assert torch.equal(together[row, :len(alone)], alone)


def test_an_export_never_generates_the_ids_its_tokenizer_has_no_token_for(tmp_path):
    """cl100k leaves ids without a token (100256, 100261-100275; reserved tokens in the export's tokenizer): made
    the likeliest, transformers' generate() still never draws them, as megadiff's never does. The padded rows
    (100277 up) stay drawable: a tokenizer extended after the export puts its new tokens there."""
    from megadiff.config import build_config
    from tests.convert_worker import MODEL, VARIANTS

    cl100k = ["data.tokenizer=cl100k_base", "model.vocab_size=100277"]  # the later vocab_size overrides MODEL's
    save_in_process(build_config({}, MODEL + VARIANTS["diff"] + cl100k), tmp_path / "ck")
    export = AutoModelForCausalLM.from_pretrained(convert_to_hf(tmp_path / "ck", tmp_path / "hf"))
    gaps = sorted(load_checkpoint(tmp_path / "ck").tokenizer.undecodable_ids)
    padding_row = 100300
    with torch.no_grad():  # rows far longer than the others: their logits lead at every position
        export.lm_head.weight[gaps + [padding_row]] *= 1000.0
        new = hf_greedy(export, torch.tensor([PROMPT]))[0].tolist()
    assert not set(new) & set(gaps) and padding_row in new
