"""`needles --attention --hf`: the attention rows read from a transformers model's layers. A plain
Llama's (and a DAA model's, scaled back by 1 - lambda) equal the weights transformers' eager
attention returns; a Dex head's effective row, applied to the head's values, gives the head's
actual output; the command reports them for an adapted export."""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from megadiff.adapt import apply_daa, apply_dex
from megadiff.adapt.export import save_adapted
from megadiff.cli import main
from megadiff.config import ConfigError
from megadiff.inference.hf_attention import hf_attention_rows
from megadiff.inference.hf_model import HFCausalLM
from tests.convert_worker import build_tokenizer
from tests.held_out_runs import prepared_data
from tests.test_adapt import perturb_adapters

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 4, 2, 8, 2
POSITION = 23  # 24 tokens: more than a head's width, so a head's values have a left inverse


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("hf_attention") / "tokenizer")


def tiny_llama(tokenizer_dir, attention: str = "sdpa"):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=HEADS * HEAD_DIM,
                         intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, initializer_range=0.2, max_position_embeddings=256,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).eval()


def adapted(tokenizer_dir, apply, config: dict, attention: str = "sdpa"):
    model = apply(tiny_llama(tokenizer_dir, attention), config, calibration=[torch.randint(0, 200, (2, 16))])
    perturb_adapters(model, 4, anneal_steps=10)
    return model


TOKENS = torch.randint(1, 200, (POSITION + 1,), generator=torch.Generator().manual_seed(3)).tolist()


def eager_rows(model) -> list[torch.Tensor]:
    with torch.no_grad():
        attentions = model(torch.tensor([TOKENS]), output_attentions=True).attentions
    return [layer[0, :, POSITION] for layer in attentions]


def test_a_plain_models_rows_are_its_eager_attention_weights(tokenizer_dir):
    model = tiny_llama(tokenizer_dir, "eager")
    rows = hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)
    assert model.config._attn_implementation == "eager"  # given back after the capture
    for ours, theirs in zip(rows, eager_rows(model), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_a_sliding_windows_rows_and_scores_are_those_it_attends(tokenizer_dir):
    """Mistral attends to its last `sliding_window` keys: the rows are its eager attention weights (no
    mass beyond the window), the capture leaves its logits as they are, and `outliers --hf` counts
    the scores of the pairs it attends alone."""
    from megadiff.inference.hf_attention import attention_calls
    from megadiff.inference.outliers import record_activations

    model = tiny_mistral(tokenizer_dir, 8)
    weights = eager_rows(model)
    rows = hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)
    for ours, theirs in zip(rows, weights, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        assert ours[:, :POSITION + 1 - 8].abs().max() == 0
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        plain = model(torch.tensor([TOKENS])).logits
        with attention_calls(model, lambda *call: None):
            torch.testing.assert_close(model(torch.tensor([TOKENS])).logits, plain)
        model.set_attn_implementation("eager")
        attentions = model(torch.tensor([TOKENS]), output_attentions=True).attentions
    attended = sum(int((layer > 0).sum()) for layer in attentions)
    report = record_activations(HFCausalLM(model, tokenizer_dir, 256), [torch.tensor([TOKENS])])
    assert report["attention_logits"]["values"] == attended


def test_daa_rows_are_the_differential_weights_normalised(tokenizer_dir):
    model = adapted(tokenizer_dir, apply_daa, {"selection": "entropy"}, "eager")
    rows = hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)
    for layer, ours, theirs in zip(model.model.layers, rows, eager_rows(model), strict=True):
        attention = layer.self_attn
        lam = attention.current_lambda().float()
        heads = attention.adapter_heads
        assert 0 < len(heads) < HEADS
        scaled = ours.clone()
        scaled[heads] = ours[heads] * (1 - lam)  # eager returns A1 - lambda A2, unnormalised
        torch.testing.assert_close(scaled, theirs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours.sum(-1), torch.ones(HEADS), rtol=1e-5, atol=1e-5)


def test_a_dex_heads_effective_row_gives_its_output(tokenizer_dir):
    """The row applied to the head's values (recomputed here from the layer's input) is the output
    the head hands its o_proj; heads Dex leaves alone keep their softmax row (the weights eager
    attention returns: Dex changes outputs, not weights)."""
    assert_dex_rows_give_the_heads_outputs(adapted(tokenizer_dir, apply_dex, {}, "eager"), tokenizer_dir)


def test_a_dex_heads_effective_row_under_a_sliding_window_stays_within_it(tokenizer_dir):
    """A sliding window's head sees its last `sliding_window` keys alone: its effective row gives its output
    from their values, and leaves the keys before the window at zero, as its softmax row does."""
    window = 12  # more keys than a head's width: their values have a left inverse
    model = apply_dex(tiny_mistral(tokenizer_dir, window), {}, calibration=[torch.randint(0, 200, (2, 16))])
    perturb_adapters(model, 4, anneal_steps=10)
    rows = assert_dex_rows_give_the_heads_outputs(model, tokenizer_dir)
    for row in rows:
        assert row[:, :POSITION + 1 - window].abs().max() == 0


def tiny_mistral(tokenizer_dir, sliding_window: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=HEADS * HEAD_DIM,
        intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        initializer_range=0.2, max_position_embeddings=256, sliding_window=sliding_window,
        attn_implementation="eager")).eval()


def assert_dex_rows_give_the_heads_outputs(model, tokenizer_dir) -> list[torch.Tensor]:
    """Checks a Dex model's rows as the test above says; returns them."""
    inputs, outputs = [], []
    hooks = []
    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs: inputs.append(kwargs["hidden_states"]), with_kwargs=True))
        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(lambda module, args: outputs.append(args[0])))
    rows = hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)
    for hook in hooks:
        hook.remove()
    softmax = eager_rows(model)
    for layer, row, base, hidden, output in zip(model.model.layers, rows, softmax, inputs, outputs, strict=True):
        attention = layer.self_attn
        values = attention.v_proj(hidden)[0].view(-1, KV_HEADS, HEAD_DIM).repeat_interleave(HEADS // KV_HEADS, 1)
        produced = output[0, POSITION].view(HEADS, HEAD_DIM)
        for head in range(HEADS):
            if head in attention.adapter_heads:
                torch.testing.assert_close(row[head] @ values[:, head].detach(), produced[head].detach(),
                                           rtol=1e-4, atol=1e-5)
            else:
                torch.testing.assert_close(row[head], base[head], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(row[attention.adapter_heads], base[attention.adapter_heads], atol=1e-3)
    return rows


def test_needles_reports_the_attention_of_an_adapted_export(tokenizer_dir, tmp_path, capsys):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    save_adapted(adapted(tokenizer_dir, apply_dex, {}), tmp_path / "dex", tokenizer=tokenizer)
    data = prepared_data(tmp_path)
    assert main(["needles", "--hf", str(tmp_path / "dex"), "--lengths", "160", "--depths", "0", "1", "--trials", "2",
                 "--attention", "--output", str(tmp_path / "dex.json"), *data]) == 0
    report = json.loads((tmp_path / "dex.json").read_text())
    assert len(report["attention_to_answer"]) == 1 and len(report["attention_noise"][0]) == 2
    assert all(value != 0 for row in report["attention_noise"] for value in row)
    save_adapted(adapted(tokenizer_dir, apply_daa, {"method": "diff_v"}), tmp_path / "diff_v", tokenizer=tokenizer)
    capsys.readouterr()
    assert main(["needles", "--hf", str(tmp_path / "diff_v"), "--lengths", "160", "--trials", "1", "--attention",
                 *data]) == 2
    assert "diff_v" in capsys.readouterr().err


def test_a_model_outside_the_attention_interface_is_refused(tokenizer_dir):
    class Silent(torch.nn.Module):  # attends without transformers' interface
        config = tiny_llama(tokenizer_dir).config

        def set_attn_implementation(self, name):
            pass

        def forward(self, **kwargs):
            return None

        def parameters(self):
            return iter([torch.zeros(1)])

    with pytest.raises(ConfigError, match="needles --attention --hf: 0 of Silent's 2 layers"):
        hf_attention_rows(HFCausalLM(Silent(), tokenizer_dir, 256), TOKENS, POSITION)


def test_a_model_whose_attention_logits_are_soft_capped_is_refused(tokenizer_dir):
    """Gemma 2 caps its attention logits, which SDPA (the capture's attention) does not."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    model = Gemma2ForCausalLM(Gemma2Config(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=HEADS * HEAD_DIM, head_dim=HEAD_DIM,
        intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256)).eval()
    with pytest.raises(ConfigError, match=r"soft-caps its attention logits \(attn_logit_softcapping=50.0\)"):
        hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)


def test_a_model_with_attention_sinks_is_refused(tokenizer_dir):
    """GraniteSWA (as gpt-oss) gives each head a learned sink logit, which SDPA (the capture's attention) leaves out:
    its rows were read, and the pass run, as another model's."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    torch.manual_seed(0)
    model = GraniteSWAForCausalLM(GraniteSWAConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=HEADS * HEAD_DIM,
        intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256, sliding_window=8)).eval()
    with pytest.raises(ConfigError, match=r"GraniteSWAForCausalLM has attention sinks \(model.layers.0.self_attn"):
        hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)


@pytest.mark.parametrize("family, unread", [("Inkling2", "sinks, position_bias"), ("Inkling", "position_bias")])
def test_a_model_whose_attention_calls_carry_what_the_reading_leaves_out_is_refused(tokenizer_dir, family, unread):
    """Inkling 2 projects each head's sink logit from the token's state (no `.sinks` parameter to find): its rows
    were read, and the pass run (logits moved by ~0.5 here), as another model's. Inkling's relative-position bias
    SDPA folds into its mask, which the rows read never saw."""
    import transformers

    config = getattr(transformers, f"{family}TextConfig")(
        vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), hidden_size=HEADS * HEAD_DIM * 2,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        swa_num_attention_heads=HEADS, swa_num_key_value_heads=KV_HEADS, swa_head_dim=HEAD_DIM, sliding_window_size=8,
        rel_extent=8, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=256)
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with pytest.raises(ConfigError, match=f"Attention is given {unread} beside its queries and keys"):
        hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)


@pytest.mark.parametrize("apply", [None, apply_dex, apply_daa])
def test_a_layers_queries_keys_and_values_are_freed_before_the_next_layer_attends(tokenizer_dir, monkeypatch, apply):
    """Only each layer's rows outlive its attention: every layer's tensors of a 64K context kept to
    the end of the pass would take some 80 GB for a 13B model."""
    model = tiny_llama(tokenizer_dir) if apply is None else adapted(tokenizer_dir, apply, {})
    sdpa, earlier, alive = ALL_ATTENTION_FUNCTIONS["sdpa"], [], []

    def watched(module, query, key, value, *args, **kwargs):  # a layer's second call may see its first's
        alive.append(sum(ref() is not None for layer, ref in earlier if layer is not module))
        earlier.extend((module, weakref.ref(tensor)) for tensor in (query, key, value))
        return sdpa(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", watched)
    rows = hf_attention_rows(HFCausalLM(model, tokenizer_dir, 256), TOKENS, POSITION)
    assert len(rows) == LAYERS and len(alive) >= LAYERS and alive == [0] * len(alive)
