"""transformers' model API on the remote-code exports (DINT, Shared DIFF): activation checkpointing
recomputes the layers and gives the same gradients, hidden states are returned and return_dict=False
gives a tuple, attention weights are refused, the SDPA implementation loads, DINT refuses assisted
decoding as transformers does for stateful models, and a cache passed with use_cache=False is read."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from megadiff.convert import convert_from_hf, convert_to_hf
from tests.convert_worker import build_tokenizer, save_in_process, variant_config

VARIANTS = ["dint", "shared_diff"]
TOKENS = torch.tensor([[5, 17, 42, 99, 7, 3, 1, 4, 1, 5, 9, 2], [8, 6, 7, 5, 3, 0, 9, 11, 12, 13, 14, 15]])


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """variant -> HF export directory with megadiff's modeling code."""
    root = tmp_path_factory.mktemp("hf_remote_code")
    tokenizer = str(build_tokenizer(root / "tokenizer"))
    out = {}
    for variant in VARIANTS:
        checkpoint = root / variant / "checkpoint"
        save_in_process(variant_config(variant, "single", tokenizer), checkpoint)
        out[variant] = convert_to_hf(checkpoint, root / variant / "hf", remote_code=True)
    return out


def load(exports, variant: str, **kwargs):
    return AutoModelForCausalLM.from_pretrained(exports[variant], trust_remote_code=True, **kwargs)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_activation_checkpointing_recomputes_the_layers_and_gives_the_same_gradients(exports, variant, reentrant):
    grads = {}
    for checkpointing in (False, True):
        model = load(exports, variant).train()
        if checkpointing:
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
        attention_calls = []
        model.model.layers[0].self_attn.register_forward_hook(lambda *args: attention_calls.append(1))
        # a cache passed in training: checkpointing must drop it, or the recompute would append to it again
        model(input_ids=TOKENS, labels=TOKENS, past_key_values=DynamicCache(config=model.config)).loss.backward()
        assert len(attention_calls) == (2 if checkpointing else 1)  # the forward, and the recompute in backward
        grads[checkpointing] = {name: p.grad for name, p in model.named_parameters()}
    for name, grad in grads[False].items():
        assert grad.abs().sum() > 0, name
        assert torch.equal(grads[True][name], grad), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_hidden_states_are_the_embeddings_and_each_layers_output_and_return_dict_false_gives_a_tuple(exports,
                                                                                                      variant):
    model = load(exports, variant)
    with torch.no_grad():
        plain = model(input_ids=TOKENS)
        out = model(input_ids=TOKENS, output_hidden_states=True)
        states = out.hidden_states
        assert plain.hidden_states is None and len(states) == model.config.num_hidden_layers + 1
        assert torch.equal(states[0], model.model.embed_tokens(TOKENS))
        position_embeddings = model.model.rotary_emb(states[0], torch.arange(TOKENS.shape[1])[None])
        assert torch.equal(states[1], model.model.layers[0](states[0], position_embeddings))
        assert torch.equal(model.lm_head(states[-1]), out.logits)  # the last one after the final norm, as Llama's
        assert torch.equal(out.logits, plain.logits)
        as_tuple = model(input_ids=TOKENS, return_dict=False)
        generated = model.generate(TOKENS[:1], max_new_tokens=2, do_sample=False, pad_token_id=0,
                                   return_dict_in_generate=True, output_hidden_states=True)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], plain.logits)
    assert all(len(step) == model.config.num_hidden_layers + 1 and all(s is not None for s in step)
               for step in generated.hidden_states)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_weights_are_refused_not_returned_as_none(exports, variant):
    model = load(exports, variant)
    with torch.no_grad(), pytest.raises(ValueError, match="output_attentions is not supported"):
        model(input_ids=TOKENS, output_attentions=True)


def test_dint_refuses_assisted_decoding_as_a_stateful_model_and_shared_diff_decodes_with_it(exports):
    prompt = torch.cat([TOKENS[:1], TOKENS[:1]], dim=1)  # repeated n-grams for prompt lookup to find
    greedy = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad(), pytest.raises(ValueError, match="assisted generation is not supported with stateful"):
        load(exports, "dint").generate(prompt, prompt_lookup_num_tokens=3, **greedy)
    shared = load(exports, "shared_diff")
    with torch.no_grad():
        assert torch.equal(shared.generate(prompt, prompt_lookup_num_tokens=3, **greedy),
                           shared.generate(prompt, **greedy))


@pytest.mark.parametrize("variant", VARIANTS)
def test_sdpa_loads_and_is_what_the_config_reports(exports, variant):
    default, sdpa = load(exports, variant), load(exports, variant, attn_implementation="sdpa")
    assert default.config._attn_implementation == sdpa.config._attn_implementation == "sdpa"
    with torch.no_grad():
        assert torch.equal(sdpa(input_ids=TOKENS).logits, default(input_ids=TOKENS).logits)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_cache_passed_with_use_cache_false_is_read(exports, variant):
    """As Llama's: use_cache only decides whether a cache is built when none is passed."""
    model = load(exports, variant)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=TOKENS[:, :8], past_key_values=cache, use_cache=True)
        rest = model(input_ids=TOKENS[:, 8:], past_key_values=cache, use_cache=False)
        full = model(input_ids=TOKENS).logits
    torch.testing.assert_close(rest.logits, full[:, 8:], rtol=1e-5, atol=1e-5)
    assert rest.past_key_values is cache and cache.get_seq_length() == TOKENS.shape[1]


def test_converting_an_export_back_reads_its_tokenizer_without_a_model_type_warning(exports, tmp_path, monkeypatch):
    """from-hf reads the export's tokenizer with the config it has read itself: transformers' own reading of a
    megadiff export's config.json (model_type megadiff, whose code it must not run) warned every conversion that
    the tokenizer "can yield errors"."""
    from transformers import configuration_utils

    warnings = []  # transformers' handler writes to the stderr it found at import, which pytest does not capture
    monkeypatch.setattr(configuration_utils.logger, "warning",
                        lambda message, *args, **kwargs: warnings.append(message))
    convert_from_hf(exports["dint"], tmp_path / "back", check=False)
    assert not [message for message in warnings if "to instantiate a model of type" in message]
