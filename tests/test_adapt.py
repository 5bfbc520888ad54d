"""Dex / DAA on tiny random Llama, Qwen2 and Mistral models: step-0 identity, the SPEC formulas
against a naive per-head implementation written here, head selection against naive scores,
lambda(t), the freeze policy, refusals, KV-cache generation and the exported HF directory."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
)

from megadiff.adapt import (
    AdaptationError, annealed_lambda, apply_daa, apply_dex, current_lambdas, plan_adaptation, set_step,
)
from megadiff.adapt.config import AdaptationConfig
from megadiff.adapt.documents import document_position_ids, model_inputs
from megadiff.adapt.apply import adapt_with_plan, adapted_modules, has_tied_head
from megadiff.adapt.export import save_adapted, save_finetuned
from megadiff.adapt.modeling_adapted import install_adapters
from megadiff.adapt.selection import attention_entropy, head_importance
from tests.test_host_syncs import ReadCounter

ARCHS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
         "mistral": (MistralConfig, MistralForCausalLM)}
VOCAB, HEADS, KV_HEADS, LAYERS = 96, 4, 2, 2
# (apply function, config) for every method and both Dex selections
VARIANTS = {
    "dex-entropy": (apply_dex, {}),
    "dex-importance": (apply_dex, {"selection": "importance"}),
    "daa": (apply_daa, {}),
    "daa-half-heads": (apply_daa, {"selection": "entropy"}),
    "diff_q": (apply_daa, {"method": "diff_q"}),
    "diff_k": (apply_daa, {"method": "diff_k"}),
    "diff_v": (apply_daa, {"method": "diff_v"}),
}


def tiny_model(arch: str, init: float = 0.02, seed: int = 0, **settings):
    config_cls, model_cls = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, initializer_range=init,
                        max_position_embeddings=128, **settings)
    return model_cls(config).eval()


def tokens(batch=2, length=12, seed=1):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def perturb_adapters(model, t: int, anneal_steps: int) -> None:
    """Move every adapter parameter away from its identity start, and lambda_learn off zero."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dex_weight", "daa_weight", "input_weight", "lambda_learn")):
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
        for layer in model.model.layers:
            layer.self_attn.anneal_steps = anneal_steps
    set_step(model, t)


# ---------------------------------------------------------------- a naive reading of the SPEC

def naive_lambda(t, T, lambda_init, lambda_learn):
    """SPEC section 6."""
    if T == 0:
        return lambda_learn
    alpha = min(1.0, t / T)
    return (1 - alpha) * (t / T) * lambda_init + alpha * lambda_learn


def naive_rope(x, theta):
    """x [N, d] for one head; rotate-half RoPE with positions 0..N-1."""
    n, d = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[:, d // 2:], x[:, :d // 2]], -1)
    return x * cos + rotated * sin


def naive_softmax_map(q, k):
    n, d = q.shape
    scores = q @ k.T / math.sqrt(d)
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(scores, -1)


def linear(x, module):
    y = x @ module.weight.T
    return y + module.bias if module.bias is not None else y


def naive_attention(attn, x, theta):
    """The adapted attention of one sequence x [N, D], head by head (SPEC sections 4-5)."""
    method, heads = attn.adapter_method, attn.adapter_heads
    d, n_heads = attn.head_dim, attn.config.num_attention_heads
    group = n_heads // attn.config.num_key_value_heads
    lam = naive_lambda(attn.step, attn.anneal_steps, attn.lambda_init, attn.lambda_learn.item())

    def split(y, h):
        return y[:, h * d:(h + 1) * d]

    q, k, v = linear(x, attn.q_proj), linear(x, attn.k_proj), linear(x, attn.v_proj)
    shifted = x @ attn.input_weight if method in ("diff_q", "diff_k", "diff_v") else None
    outputs = []
    for h in range(n_heads):
        g = h // group
        q_h, k_g, v_g = naive_rope(split(q, h), theta), naive_rope(split(k, g), theta), split(v, g)
        a1 = naive_softmax_map(q_h, k_g)
        if h not in heads:
            out = a1 @ v_g
        elif method == "dex":
            o = a1 @ v_g
            out = o - lam * o @ attn.dex_weight[heads.index(h)]
        elif method == "daa":
            weight = attn.daa_weight[heads.index(h)]
            q2 = naive_rope(split(q, h) @ weight, theta) if attn.daa_weight_before_rope else q_h @ weight
            out = (a1 - lam * naive_softmax_map(q2, k_g)) @ v_g
        elif method == "diff_q":
            q2 = naive_rope(split(linear(shifted, attn.q_proj), h), theta)
            out = (a1 - lam * naive_softmax_map(q2, k_g)) @ v_g
        elif method == "diff_k":
            k2 = naive_rope(split(linear(shifted, attn.k_proj), g), theta)
            out = (a1 - lam * naive_softmax_map(q_h, k2)) @ v_g
        else:  # diff_v
            out = a1 @ (v_g - lam * split(linear(shifted, attn.v_proj), g))
        outputs.append(out)
    return linear(torch.cat(outputs, -1), attn.o_proj)


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_at_step_zero_equal_the_original(arch, variant):
    apply, config = VARIANTS[variant]
    model = tiny_model(arch, init=0.2)
    x = tokens()
    with torch.no_grad():
        expected = model(x).logits
        adapted = apply(copy.deepcopy(model), config, calibration=[tokens(seed=5)])
        assert torch.equal(adapted(x).logits, expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_adapted_attention_matches_naive_per_head_formula(arch, variant):
    apply, config = VARIANTS[variant]
    assert_matches_naive_formula(apply(tiny_model(arch, init=0.2), config, calibration=[tokens(seed=5)]).double())


def window_reading_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, sliding_window=None,
                             **kwargs):
    """Causal attention that, as flash attention does, reads the window from its caller's `sliding_window` (not from
    the mask transformers built): each query attends to its last `sliding_window` keys when one is passed."""
    queries, keys = torch.arange(query.shape[-2]) + key.shape[-2] - query.shape[-2], torch.arange(key.shape[-2])
    allowed = keys[None, :] <= queries[:, None]
    if sliding_window is not None:
        allowed &= queries[:, None] - keys[None, :] < sliding_window
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling)
    return output.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("arch", ARCHS)
def test_adapted_attention_passes_the_window_its_stock_attention_passes(arch):
    """A Llama whose config.json names a sliding_window (carried over from another architecture's) attends over
    every position in transformers, whose Llama attention passes no window; the adapted one passed the config's to
    the attention function, so under flash attention the adapted model attended within that window at step 0: no
    longer the pretrained model. Qwen2's per-layer and Mistral's windows are passed as their own attention passes
    them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("window_reading", window_reading_attention)
    AttentionMaskInterface.register("window_reading", sdpa_mask)
    model = tiny_model(arch, init=0.2, sliding_window=4, attn_implementation="window_reading")
    x = tokens(length=12)
    with torch.no_grad():
        expected = model(x).logits
        for apply, config in (VARIANTS["dex-entropy"], VARIANTS["diff_k"]):
            assert torch.equal(apply(copy.deepcopy(model), config, calibration=[tokens(seed=5)])(x).logits, expected)


def test_daa_planned_before_the_rope_setting_was_recorded_keeps_w_daa_after_rope():
    """A DAA run planned (adaptation.json) before megadiff moved W_DAA before RoPE resumes as it began."""
    model = tiny_model("llama", init=0.2)
    plan = plan_adaptation(model, AdaptationConfig(method="daa"), calibration=[tokens(seed=5)])
    assert plan.pop("daa_weight_before_rope") is True
    install_adapters(model, plan)
    assert not model.model.layers[0].self_attn.daa_weight_before_rope
    assert_matches_naive_formula(model.double())


def assert_matches_naive_formula(model):
    x = tokens(batch=2, length=10)
    captured = {}

    def capture(index):
        def hook(_module, args, kwargs, output):
            captured[index] = (kwargs.get("hidden_states", args[0] if args else None), output[0])
        return hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_hook(capture(i), with_kwargs=True)
    theta = model.config.rope_parameters["rope_theta"]
    for step in (3, 25):  # during the annealing (T = 10) and after it
        perturb_adapters(model, step, anneal_steps=10)
        with torch.no_grad():
            model(x)
            for i, layer in enumerate(model.model.layers):
                hidden, output = captured[i]
                for b in range(x.shape[0]):
                    torch.testing.assert_close(output[b], naive_attention(layer.self_attn, hidden[b], theta),
                                               rtol=1e-6, atol=1e-6)
    attention = model.model.layers[0].self_attn  # its adapted heads' index goes to the device once, not per use
    assert attention._head_index(x.device) is attention._head_index(x.device)


@pytest.mark.parametrize("variant", VARIANTS)
def test_adapted_attention_depends_on_relative_positions_only(variant):
    """Like the pretrained attention under RoPE: a sequence read from position 0 or from position 37
    gives the same logits, with every adapter trained away from the identity."""
    apply, config = VARIANTS[variant]
    model = apply(tiny_model("llama", init=0.2), config, calibration=[tokens(seed=5)]).double()
    perturb_adapters(model, 25, anneal_steps=10)
    x = tokens(batch=2, length=10)
    positions = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        shifted, unshifted = (model(x, position_ids=at).logits for at in (positions + 37, positions))
        torch.testing.assert_close(shifted, unshifted, rtol=0, atol=1e-5)  # HF computes RoPE angles in fp32


def naive_entropy(model, batches):
    """Mean row entropy per head from transformers' own returned attention maps."""
    model.set_attn_implementation("eager")
    totals, rows = torch.zeros(LAYERS, HEADS, dtype=torch.float64), 0
    with torch.no_grad():
        for x in batches:
            for layer, maps in enumerate(model(x, output_attentions=True).attentions):
                p = maps.double()
                logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
                totals[layer] += -(p * logp).sum(-1).sum((0, 2))
            rows += x.numel()
    model.set_attn_implementation("sdpa")
    return totals / rows


def naive_importance(model, batches, eps=3e-3):
    """Mean over examples of |dL_example/d gate_h| by central differences of a head gate on o_proj's input.
    (transformers' RMSNorm computes in float32 even in a float64 model, so eps cannot be tiny.)"""
    model = copy.deepcopy(model).double()
    gate = {}

    def gate_input(layer):
        def pre_hook(_module, args):
            y = args[0].clone()
            if gate.get("layer") == layer:
                h, value = gate["head"], gate["value"]
                y[..., h * 8:(h + 1) * 8] *= value  # head_dim = 32 / 4
            return (y,)
        return pre_hook

    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj.register_forward_pre_hook(gate_input(i))

    def example_losses(x):
        logits = model(x).logits
        return torch.stack([F.cross_entropy(logits[b, :-1], x[b, 1:]) for b in range(x.shape[0])])

    totals, examples = torch.zeros(LAYERS, HEADS, dtype=torch.float64), 0
    with torch.no_grad():
        for x in batches:
            for layer in range(LAYERS):
                for head in range(HEADS):
                    gate.update(layer=layer, head=head, value=1 + eps)
                    up = example_losses(x)
                    gate.update(value=1 - eps)
                    down = example_losses(x)
                    totals[layer, head] += ((up - down) / (2 * eps)).abs().sum()
            examples += x.shape[0]
    return totals / examples


@pytest.mark.parametrize("arch", ARCHS)
def test_entropy_selection_matches_naive_entropy(arch):
    model = tiny_model(arch, init=0.3)
    batches = [tokens(seed=s) for s in (2, 3)]
    expected = naive_entropy(copy.deepcopy(model), batches)
    torch.testing.assert_close(attention_entropy(model, batches).double(), expected, rtol=1e-5, atol=1e-6)
    plan = plan_adaptation(model, AdaptationConfig(), batches)
    for layer, row in enumerate(expected):
        assert plan["layers"][layer]["heads"] == sorted(row.argsort(descending=True)[:HEADS // 2].tolist())


def test_document_position_ids_restart_after_each_eos():
    eos = 0
    input_ids = torch.tensor([[5, 6, eos, 7, eos, 8], [eos, 1, 2, 3, 4, eos]])
    assert document_position_ids(input_ids, eos).tolist() == [[0, 1, 2, 0, 1, 0], [0, 0, 1, 2, 3, 4]]
    assert "position_ids" not in model_inputs(input_ids, None)


def packed_documents(eos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first document with its EOS, second document, the two packed in one row)."""
    first = torch.cat([tokens(1, 5, seed=2).clamp(min=1), torch.tensor([[eos]])], dim=1)
    second = tokens(1, 7, seed=3).clamp(min=1)
    return first, second, torch.cat([first, second], dim=1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("variant", ["dex-entropy", "daa", "diff_k", "diff_v"])
def test_document_masking_attends_within_each_packed_document(arch, variant):
    """data.document_masking's inputs through the adapted attention: the second document's logits
    are its logits alone; without them the first document leaks in."""
    apply, config = VARIANTS[variant]
    model = apply(tiny_model(arch, init=0.2), config, calibration=[tokens(seed=5)])
    perturb_adapters(model, 2, anneal_steps=4)
    first, second, packed = packed_documents()
    with torch.no_grad():
        masked = model(**model_inputs(packed, 0)).logits
        plain = model(**model_inputs(packed, None)).logits
        alone = model(second).logits
    torch.testing.assert_close(masked[:, first.shape[1]:], alone, rtol=1e-5, atol=1e-5)
    assert (plain[:, first.shape[1]:] - alone).abs().max() > 1e-3


def test_entropy_is_measured_in_windows_of_bounded_length(monkeypatch):
    """Long rows are measured a window at a time (eager attention keeps [heads, N, N]): as the naive
    entropy of the rows cut into those windows, and no attention map is wider than one."""
    from megadiff.adapt import selection

    model = tiny_model("llama", init=0.3)
    batches = [tokens(seed=s) for s in (2, 3)]
    window = batches[0].shape[1] // 3 + 1  # two whole windows and a shorter last one
    monkeypatch.setattr(selection, "ENTROPY_WINDOW", window)
    pieces = [row[None, start:start + window] for x in batches for row in x for start in range(0, x.shape[1], window)]
    expected = naive_entropy(copy.deepcopy(model), pieces)
    widths = []
    model.model.layers[0].self_attn.register_forward_hook(lambda _m, _a, output: widths.append(output[1].shape[-1]))
    torch.testing.assert_close(attention_entropy(model, batches).double(), expected, rtol=1e-5, atol=1e-6)
    assert max(widths) == window and len(widths) == len(pieces)


def test_entropy_selection_measures_each_packed_document_alone():
    """Masked, the packed row's entropy sums are those of its documents measured separately."""
    model = tiny_model("llama", init=0.3)
    first, second, packed = packed_documents()
    total = attention_entropy(model, [packed], document_eos=0).double() * packed.shape[1]
    apart = sum(attention_entropy(model, [doc]).double() * doc.shape[1] for doc in (first, second))
    torch.testing.assert_close(total, apart, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(attention_entropy(model, [packed]).double() * packed.shape[1], apart, rtol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
def test_importance_selection_matches_finite_differences(arch):
    model = tiny_model(arch, init=0.3)
    batches = [tokens(seed=s) for s in (2, 3)]
    expected = naive_importance(model, batches)
    torch.testing.assert_close(head_importance(model, batches).double(), expected, rtol=2e-3, atol=1e-5)
    plan = plan_adaptation(model, AdaptationConfig(selection="importance", heads_fraction=0.25), batches)
    for layer, row in enumerate(expected):
        assert plan["layers"][layer]["heads"] == [int(row.argmin())]


def test_lambda_schedule_follows_spec():
    for T in (0, 1, 10, 1000):
        for t in (0, 1, 3, 5, 10, 11, 2000):
            for lambda_init, lambda_learn in ((0.2, 0.0), (0.8, -0.35), (0.5, 1.7)):
                assert annealed_lambda(t, T, lambda_init, lambda_learn) == pytest.approx(
                    naive_lambda(t, T, lambda_init, lambda_learn), abs=1e-12)
    model = apply_dex(tiny_model("llama"), {"anneal_steps": 8}, calibration=[tokens()])
    perturb_adapters(model, 0, anneal_steps=8)
    for t in (0, 2, 4, 8, 30):
        set_step(model, t)
        with torch.no_grad():
            model(tokens())
        for layer, value in enumerate(current_lambdas(model).values()):
            attn = model.model.layers[layer].self_attn
            depth_init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # SPEC section 0, l = layer + 1
            assert attn.lambda_init == pytest.approx(depth_init)
            assert value == pytest.approx(naive_lambda(t, 8, depth_init, attn.lambda_learn.item()), abs=1e-6)
    assert current_lambdas(apply_dex(tiny_model("llama"), {"selection": "all"})) == {"layer_0": 0.0, "layer_1": 0.0}


def test_lambda_schedule_of_a_bf16_model_is_not_rounded_to_bf16():
    """lambda(t) of a bf16 model is SPEC 6's value for its (bf16) lambda_learn to fp32's precision at every step, as
    the differential layers compute theirs: in the model's dtype the ramp of lambda_init was a staircase of bf16 steps
    (311 distinct values over 1000 annealing steps, up to 0.7% off)."""
    model = apply_dex(tiny_model("llama"), {"anneal_steps": 1000}, calibration=[tokens()]).to(torch.bfloat16)
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.lambda_learn.fill_(0.01)
    fp32_eps = torch.finfo(torch.float32).eps
    for t in range(0, 1002, 7):
        attn.step = t
        want = naive_lambda(t, 1000, attn.lambda_init, attn.lambda_learn.double().item())
        assert attn.current_lambda().item() == pytest.approx(want, rel=4 * fp32_eps, abs=1e-30), t


@pytest.mark.parametrize("variant", ["dex-entropy", "daa", "diff_q", "diff_k"])
def test_bf16_adapted_heads_round_their_difference_once(variant):
    """With the adapter matrices at the identity, an adapted head's two outputs are the stock head's O, and the
    adapted one (1 - lambda) O: in bf16 it must be that product rounded once (within one bf16 step of its exact
    value). Computed in bf16, lambda O was rounded before the subtraction, which cancels most of it: lambda / (1 -
    lambda) bf16 steps off (4 at lambda 0.8)."""
    apply, config = VARIANTS[variant]
    stock = tiny_model("llama", init=0.2).to(torch.bfloat16)
    adapted = apply(copy.deepcopy(stock).float(), {**config, "anneal_steps": 0}, calibration=[tokens()])
    adapted = adapted.to(torch.bfloat16)
    outputs = {}
    for name, model in (("stock", stock), ("adapted", adapted)):
        attn = model.model.layers[0].self_attn
        attn.o_proj.register_forward_pre_hook(lambda module, args, name=name: outputs.__setitem__(name, args[0]))
    attn = adapted.model.layers[0].self_attn
    with torch.no_grad():
        attn.lambda_learn.fill_(0.8)
        for model in (stock, adapted):
            model(tokens(batch=4, length=64))
    d, heads = attn.head_dim, attn.adapter_heads
    columns = torch.cat([torch.arange(h * d, (h + 1) * d) for h in heads])
    exact = (1 - attn.lambda_learn.double()) * outputs["stock"][..., columns].double()
    error = (outputs["adapted"][..., columns].double() - exact).abs()
    assert (error <= torch.finfo(torch.bfloat16).eps * exact.abs()).all(), (error / exact.abs()).max().item()


def trained(model) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_freeze_policy(arch):
    dex = apply_dex(tiny_model(arch), {"selection": "all"})
    expected = set()
    for i in range(LAYERS):
        prefix = f"model.layers.{i}.self_attn."
        expected |= {prefix + n for n in ("k_proj.weight", "v_proj.weight", "o_proj.weight", "dex_weight",
                                          "lambda_learn")}
        if arch == "qwen2":  # Qwen2's K/V projections have biases
            expected |= {prefix + "k_proj.bias", prefix + "v_proj.bias"}
    assert trained(dex) == expected
    for method, extra in (("daa", "daa_weight"), ("diff_k", "input_weight")):  # DAA appendix E.2
        daa = apply_daa(tiny_model(arch), {"method": method})
        attention = {n for n, _ in daa.named_parameters() if ".self_attn." in n}
        assert trained(daa) == attention | {"lm_head.weight"} and any(n.endswith(extra) for n in attention)
    tied = apply_daa(tiny_model(arch, tie_word_embeddings=True))  # its head is the embedding: that stays frozen
    assert trained(tied) == {n for n, _ in tied.named_parameters() if ".self_attn." in n}
    everything = apply_dex(tiny_model(arch), {"selection": "all", "trainable": ["*"]})
    assert trained(everything) == {n for n, _ in everything.named_parameters()}
    with pytest.raises(AdaptationError, match="trainable"):
        apply_dex(tiny_model(arch), {"selection": "all", "trainable": ["*.no_such_param"]})


def test_refusals_name_the_problem():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB))
    with pytest.raises(AdaptationError, match="LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        apply_dex(gpt2)
    model = apply_dex(tiny_model("llama"), {"selection": "all"})
    with pytest.raises(AdaptationError, match="already adapted"):
        apply_daa(model)
    with pytest.raises(AdaptationError, match="selection"):
        apply_daa(tiny_model("llama"), {"method": "diff_v", "selection": "entropy"})
    with pytest.raises(AdaptationError, match="unknown key"):
        apply_dex(tiny_model("llama"), {"lambda": 0.5})
    with pytest.raises(AdaptationError, match="method"):
        apply_dex(tiny_model("llama"), {"method": "daa"})
    with pytest.raises(AdaptationError, match=r"selected_heads\[1\]"):
        apply_dex(tiny_model("llama"), {"selected_heads": [[0], [4]]})
    with pytest.raises(AdaptationError, match="no Dex/DAA layers"):
        set_step(tiny_model("llama"), 3)


def test_default_config_is_the_papers():
    model = tiny_model("llama", init=0.3)
    with pytest.warns(UserWarning, match="random tokens"):
        apply_dex(model)
    for i, layer in enumerate(model.model.layers):
        assert len(layer.self_attn.adapter_heads) == HEADS // 2
        assert layer.self_attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * i))
        assert layer.self_attn.adapter_method == "dex"
    assert trained(model) and not any("q_proj" in n or "mlp" in n for n in trained(model))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_control_keeps_the_stock_model_trains_daa_s_parameters_and_saves_it_stock(arch, tmp_path):
    """adaptation.method finetune: a Dex recipe's head and lambda settings plan no adapter, the model computes what
    it did, the attention modules and the LM head train (DAA's FT), and the export loads without remote code as
    the stock class, with the trained model's logits."""
    model = tiny_model(arch, init=0.2)
    original, x = copy.deepcopy(model), tokens()
    config = AdaptationConfig(method="finetune", selection="entropy", heads_fraction=0.25, calibration_batches=8)
    plan = plan_adaptation(model, config)
    assert plan["layers"] == []
    adapt_with_plan(model, plan, config.trainable_patterns(has_tied_head(model)))
    assert not adapted_modules(model) and type(model) is type(original)
    assert trained(model) == {n for n, _ in model.named_parameters() if ".self_attn." in n} | {"lm_head.weight"}
    with torch.no_grad():
        assert torch.equal(model(x).logits, original(x).logits)
        for param in (p for p in model.parameters() if p.requires_grad):  # as training moves them
            param.add_(0.01 * torch.randn_like(param))
    save_finetuned(model, tmp_path / "hf")
    assert not list((tmp_path / "hf").glob("*.py"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded) is type(original)
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)


@pytest.mark.parametrize("arch,variant", [("llama", "dex-entropy"), ("qwen2", "daa-half-heads"), ("mistral", "diff_q"),
                                          ("llama", "diff_k"), ("qwen2", "diff_v"), ("mistral", "dex-importance")])
def test_generate_with_kv_cache_equals_without(arch, variant):
    apply, config = VARIANTS[variant]
    model = apply(tiny_model(arch, init=0.2), config, calibration=[tokens(seed=5)])
    perturb_adapters(model, 4, anneal_steps=10)
    prompt = tokens(batch=2, length=5, seed=9)
    runs = [model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=cache, output_scores=True,
                           return_dict_in_generate=True, pad_token_id=0) for cache in (True, False)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for cached, uncached in zip(runs[0].scores, runs[1].scores):
        torch.testing.assert_close(cached, uncached, rtol=1e-4, atol=1e-5)


def test_an_export_killed_while_written_leaves_no_directory_by_its_name(tmp_path, monkeypatch):
    """Written in place, an export cut short after the weights loaded as the base Llama (its config.json), the
    adapters' weights ignored: it is written aside, and a previous export stays whole until the new one is."""
    from megadiff.adapt import export

    apply, config = VARIANTS["daa"]
    model = apply(tiny_model("llama", init=0.2), config, calibration=[tokens(seed=5)])
    save_adapted(model, tmp_path / "hf")
    previous = sorted(path.name for path in (tmp_path / "hf").iterdir())

    def killed(*args):
        raise KeyboardInterrupt  # as a kill between the adapted config and the model code would leave it
    monkeypatch.setattr(export.shutil, "copyfile", killed)
    for directory in (tmp_path / "new", tmp_path / "hf"):
        with pytest.raises(KeyboardInterrupt):
            save_adapted(model, directory)
    assert not (tmp_path / "new").exists()
    assert sorted(path.name for path in (tmp_path / "hf").iterdir()) == previous
    monkeypatch.undo()
    save_adapted(model, tmp_path / "new")  # a rerun writes it whole, over the killed one's leftovers
    assert sorted(path.name for path in (tmp_path / "new").iterdir()) == previous


def _saved_with_remote_code(arch: str, variant: str, tmp_path, monkeypatch):
    """A tiny adapted model, annealed to step 6, saved into tmp_path/hf (its code cached under tmp_path)."""
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))
    apply, config = VARIANTS[variant]
    model = apply(tiny_model(arch, init=0.2), config, calibration=[tokens(seed=5)])
    perturb_adapters(model, 6, anneal_steps=10)
    save_adapted(model, tmp_path / "hf")
    return model


@pytest.mark.parametrize("arch,variant", [("llama", "dex-entropy"), ("qwen2", "diff_k"), ("mistral", "daa")])
def test_saved_directory_loads_with_remote_code(arch, variant, tmp_path, monkeypatch):
    model = _saved_with_remote_code(arch, variant, tmp_path, monkeypatch)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert type(loaded).__name__.startswith("Adapted") and loaded.config.adaptation["step"] == 6
    x = tokens()
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    prompt = tokens(batch=1, length=4)
    assert torch.equal(loaded.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0),
                       model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0))
    # annealed on in plain transformers, then saved: the copy had reloaded at the step it was exported at
    loaded.set_adaptation_step(9)
    set_step(model, 9)
    assert current_lambdas(loaded) == current_lambdas(model)  # megadiff's helpers know the remote-code copy
    loaded.save_pretrained(tmp_path / "annealed")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "annealed", trust_remote_code=True).eval()
    assert again.config.adaptation["step"] == 9
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


@pytest.mark.parametrize("arch,variant", [("llama", "daa"), ("qwen2", "dex-entropy"), ("mistral", "diff_k")])
def test_saved_directory_loads_as_a_base_model_with_its_adapters(arch, variant, tmp_path, monkeypatch):
    """AutoModel (hidden states: embeddings, probes, retrieval) loads the export as megadiff's own exports load:
    the adapted decoder, its adapters' weights read, not refused as an unknown configuration."""
    from transformers import AutoModel

    model = _saved_with_remote_code(arch, variant, tmp_path, monkeypatch)
    base = AutoModel.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    x = tokens()
    with torch.no_grad():
        assert torch.equal(base(x).last_hidden_state, model.model(x).last_hidden_state)


def test_a_chat_tuned_export_stops_generating_at_the_templates_end_of_turn(tmp_path):
    """A base model whose EOS is not ChatML's <|im_end|> (Qwen2's <|endoftext|>), tuned on conversations: the
    export's generate() must stop at the end of the assistant's turn, as megadiff's own exports do, not run on
    into made-up turns. A template ending turns with the EOS itself adds nothing."""
    from pathlib import Path

    from transformers import AutoTokenizer, GenerationConfig

    from tests.convert_worker import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tokenizer", bos="<|im_end|>"))
    end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    assert end != eos
    model = apply_dex(tiny_model("qwen2", eos_token_id=eos), {}, calibration=[tokens(seed=5)])
    templates = {"chatml": (Path(__file__).resolve().parents[1] / "configs/chat/chatml.jinja").read_text(),
                 "eos": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"}
    for name, expected in (("chatml", [eos, end]), ("eos", eos)):
        tokenizer.chat_template = templates[name]
        save_adapted(model, tmp_path / name, tokenizer=tokenizer)
        assert GenerationConfig.from_pretrained(tmp_path / name).eos_token_id == expected


def test_a_chat_tuned_export_keeps_a_base_models_sampling_settings_that_transformers_reads(tmp_path):
    """A base model whose generation_config.json sets temperature and top_p without do_sample (Vicuna's, as
    transformers 4.3x wrote them): from_pretrained reads it, but transformers refuses to save it once changed, and
    the export failed after the whole adaptation. Reference: the settings as the base model's directory holds them."""
    from transformers import AutoTokenizer, GenerationConfig

    from tests.convert_worker import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(build_tokenizer(tmp_path / "tokenizer", bos="<|im_end|>"))
    tokenizer.chat_template = (Path(__file__).resolve().parents[1] / "configs/chat/chatml.jinja").read_text()
    end, eos = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id
    base = tiny_model("llama", eos_token_id=eos)
    base.save_pretrained(tmp_path / "base")
    sampling = {"temperature": 0.9, "top_p": 0.6}
    written = json.loads((tmp_path / "base" / "generation_config.json").read_text())
    (tmp_path / "base" / "generation_config.json").write_text(json.dumps({**written, **sampling}))
    model = apply_dex(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), {}, calibration=[tokens(seed=5)])
    save_adapted(model, tmp_path / "hf", tokenizer=tokenizer)
    exported = GenerationConfig.from_pretrained(tmp_path / "hf")
    assert exported.eos_token_id == [eos, end]
    assert {key: getattr(exported, key) for key in sampling} == sampling


@pytest.mark.parametrize("bad_row", [[], [1, 1], [-1]], ids=["empty", "repeated", "negative"])
def test_given_heads_refuse_empty_repeated_or_negative_rows(bad_row):
    """selected_heads is the user's own choice of heads: a layer given no head, a head twice, or a negative
    index (which Python would read from the end) must be refused by name, not adapted as something else."""
    with pytest.raises(AdaptationError, match=r"selected_heads\[1\]"):
        apply_dex(tiny_model("llama"), {"selected_heads": [[0], bad_row]})


def test_configured_lambda_settings_reach_every_adapted_layer():
    """A constant lambda_init, lambda_learn_init and anneal_steps T set in the config are the ones each
    adapted layer starts from: lambda(t) follows the user's schedule, not the defaults."""
    config = {"selection": "all", "lambda_init": 0.3, "lambda_learn_init": 0.25, "anneal_steps": 7}
    for apply, method in ((apply_dex, "dex"), (apply_daa, "daa")):
        model = apply(tiny_model("llama"), {**config, "method": method})
        for layer in model.model.layers:
            attn = layer.self_attn
            assert attn.lambda_init == pytest.approx(config["lambda_init"])
            assert attn.anneal_steps == config["anneal_steps"]
            assert attn.lambda_learn.item() == pytest.approx(config["lambda_learn_init"])
        half = config["anneal_steps"] // 2
        set_step(model, half)
        expected = naive_lambda(half, config["anneal_steps"], config["lambda_init"], config["lambda_learn_init"])
        assert current_lambdas(model) == {f"layer_{i}": pytest.approx(expected) for i in range(LAYERS)}


def test_a_share_too_small_for_one_head_still_adapts_one_per_layer():
    """heads_fraction x heads below 1 (0.1 of 4 heads) adapts at least one head of each layer
    (k = max(1, floor(fraction x heads))): a layer silently left unadapted would train nothing of Dex's."""
    plan = plan_adaptation(tiny_model("llama", init=0.3), AdaptationConfig(heads_fraction=0.1), [tokens()])
    assert [len(layer["heads"]) for layer in plan["layers"]] == [1] * LAYERS


def test_without_calibration_data_the_configured_count_of_random_batches_is_measured(monkeypatch):
    """With no calibration batches given, head selection falls back to random tokens (with a warning), as many
    batches as calibration_batches asks: the user's count sets how much the measurement averages over."""
    import megadiff.adapt.apply as apply_module

    measured = []

    def select(model, selection, fraction, batches, document_eos=None):
        measured.extend(batches)
        return [list(range(HEADS // 2)) for _ in range(LAYERS)]

    monkeypatch.setattr(apply_module, "select_heads", select)
    with pytest.warns(UserWarning, match="random tokens"):
        apply_dex(tiny_model("llama"), {"calibration_batches": 3})
    assert len(measured) == 3 and all(int(batch.max()) < VOCAB for batch in measured)


def test_the_logged_lambdas_are_read_from_the_device_at_once():
    """Every logged step reads each layer's lambda: one read in all (each waits on a GPU), whatever the depth,
    with the values a float() of each gives."""
    model = apply_dex(tiny_model("llama"), {"selection": "all", "lambda_learn_init": 0.3})
    set_step(model, 3)
    with torch.no_grad():
        model(tokens())
    expected = {f"layer_{layer}": float(module.last_lambda) for layer, module in enumerate(adapted_modules(model))}
    with ReadCounter() as reads:
        reads.counting = True
        assert current_lambdas(model) == expected
    assert sum(reads.sites.values()) == 1, reads.sites
