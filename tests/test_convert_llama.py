"""from-hf of a stock transformers LlamaForCausalLM (random, built here): a megadiff softmax
checkpoint for continued pre-training whose logits are the Llama's, whose config is derived
from config.json, whose tokenizer travels with it, and which exports back to the same tensors."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from megadiff.checkpoint.format import checkpoint_config
from megadiff.config import ConfigError, build_config
from megadiff.convert import convert_from_hf, convert_to_hf
from megadiff.convert.hf_layout import ConversionError
from megadiff.data.tokenizers import load_tokenizer
from megadiff.inference import load_checkpoint
from tests.convert_worker import TEXT, build_tokenizer


def stock_llama(directory, tied: bool, rope_theta: float = 500.0, bos: str | None = None, hidden_act: str = "silu",
                rope_parameters: dict | None = None):
    """`rope_parameters`: besides the base (a scaling's)."""
    build_tokenizer(directory, bos)
    rope = {"rope_type": "default", **(rope_parameters or {}), "rope_theta": rope_theta}
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         rms_norm_eps=1e-5, rope_parameters=rope,
                         tie_word_embeddings=tied, bos_token_id=1 if bos else 0, eos_token_id=0,
                         hidden_act=hidden_act)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms away from 1 so that each one matters
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(directory)
    return model.eval()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_stock_llama_becomes_a_megadiff_softmax_checkpoint(tmp_path, tied):
    llama = stock_llama(tmp_path / "llama", tied)
    checkpoint = convert_from_hf(tmp_path / "llama", tmp_path / "megadiff")

    cfg = checkpoint_config(checkpoint)
    assert (cfg.model.variant, cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads,
            cfg.model.num_kv_heads, cfg.model.ffn_hidden_size, cfg.model.seq_length, cfg.model.rope_theta,
            cfg.model.tie_embeddings) == ("softmax", 2, 64, 4, 2, 96, 64, 500.0, tied)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    assert tokenizer.encode(TEXT) == load_tokenizer(str(tmp_path / "llama")).encode(TEXT)

    ours = load_checkpoint(checkpoint)
    assert ours.vocab_size == 300  # the Llama's vocabulary, not padded further
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)

    exported = convert_to_hf(checkpoint, tmp_path / "back")
    assert type(AutoModelForCausalLM.from_pretrained(exported)).__name__ == "LlamaForCausalLM"
    original, back = load_file(str(tmp_path / "llama" / "model.safetensors")), load_file(str(exported / "model.safetensors"))
    assert back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor), name


def test_a_llama_whose_activation_is_named_swish_converts_as_the_silu_it_is(tmp_path):
    """transformers runs hidden_act "swish" as SiLU (ACT2FN), the same model as "silu": from-hf refused it."""
    llama = stock_llama(tmp_path / "llama", tied=False, hidden_act="swish")
    ours = load_checkpoint(convert_from_hf(tmp_path / "llama", tmp_path / "megadiff"))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)


def test_a_conversion_killed_while_written_leaves_no_checkpoint_and_a_rerun_converts(tmp_path, monkeypatch):
    """Written in place, from-hf killed before its tokenizer left a checkpoint that loaded, naming a tokenizer
    it lacked, and a rerun refused its non-empty directory."""
    from transformers import PreTrainedTokenizerBase

    stock_llama(tmp_path / "llama", tied=False)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(PreTrainedTokenizerBase, "save_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)
    assert not (tmp_path / "megadiff").exists()
    monkeypatch.undo()
    checkpoint = convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)
    assert load_tokenizer(checkpoint_config(checkpoint).data.tokenizer).vocab_size == 300
    assert not list(tmp_path.glob("*.partial"))


def test_a_conversion_that_cannot_write_is_refused_and_gives_back_its_space(tmp_path, monkeypatch):
    """A full disk under from-hf: megatron's writers said "Worker failure: ... unexpected pos", and the part
    written stayed beside the output, filling the disk for the next command."""
    import errno

    from megadiff.convert import from_hf

    stock_llama(tmp_path / "llama", tied=False)
    save_model_weights = from_hf.save_model_weights

    def disk_full(chunks, cfg, directory):
        save_model_weights(chunks, cfg, directory)
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "common.pt"))
    monkeypatch.setattr(from_hf, "save_model_weights", disk_full)
    with pytest.raises(ConversionError, match=r"megadiff could not be written \(.*No space left on device"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["llama"]


def test_a_vocabulary_padded_before_conversion_trains_tensor_parallel(tmp_path):
    """docs/conversion.md's way to train an odd vocabulary (a Llama's 32,001) at parallel.tensor > 1: the
    conversion keeps a vocabulary as it is, so it is padded in transformers first."""
    from megadiff.config import ConfigError
    from megadiff.training.state import _check_same_vocabulary

    llama = stock_llama(tmp_path / "llama", tied=False)
    llama.resize_token_embeddings(301)  # an added token: 301 rows pad to no multiple but 1
    llama.resize_token_embeddings(301, pad_to_multiple_of=128)
    llama.save_pretrained(tmp_path / "padded")
    load_tokenizer(str(tmp_path / "llama")).save_hf(tmp_path / "padded")
    checkpoint = convert_from_hf(tmp_path / "padded", tmp_path / "megadiff")
    cfg = checkpoint_config(checkpoint)
    assert (cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by) == (384, 128)

    def at_tensor_parallel(*overrides: str):
        return cfg.model_copy(update={"model": cfg.model.model_copy(update=dict(overrides)),
                                      "parallel": cfg.parallel.model_copy(update={"tensor": 2})})

    with pytest.raises(ConfigError, match="set model.make_vocab_size_divisible_by=64, which pads to 384"):
        _check_same_vocabulary(cfg, at_tensor_parallel(), checkpoint)
    _check_same_vocabulary(cfg, at_tensor_parallel(("make_vocab_size_divisible_by", 64)), checkpoint)


def test_from_hf_pads_an_odd_vocabulary_for_tensor_parallel_training(tmp_path, capsys):
    """`--pad-vocab 128` does in the conversion what docs/conversion.md's transformers step does before it:
    301 rows become 384, the new ones the old rows' mean, the Llama's own logits unchanged."""
    from megadiff.cli import main
    from megadiff.training.state import _check_same_vocabulary

    llama = stock_llama(tmp_path / "llama", tied=False)
    llama.resize_token_embeddings(301)  # an added token: 301 rows pad to no multiple but 1
    llama.save_pretrained(tmp_path / "odd")
    load_tokenizer(str(tmp_path / "llama")).save_hf(tmp_path / "odd")
    assert main(["convert", "from-hf", "--load", str(tmp_path / "odd"), "--save", str(tmp_path / "megadiff"),
                 "--pad-vocab", "128"]) == 0
    assert "padded from 301 to 384 rows" in capsys.readouterr().out
    checkpoint = tmp_path / "megadiff"
    cfg = checkpoint_config(checkpoint)
    assert (cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by) == (301, 128)

    ours = load_checkpoint(checkpoint)
    assert ours.vocab_size == 384
    weights = ours.parameters_by_name()
    for name, theirs in (("embedding.word_embeddings.weight", llama.model.embed_tokens.weight),
                         ("output_layer.weight", llama.lm_head.weight)):
        assert torch.equal(weights[name][:301], theirs.detach())
        torch.testing.assert_close(weights[name][301:], theirs.detach().mean(0).expand(83, -1))
    ids = torch.randint(0, 301, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :301], llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)
    padded_per_rank = cfg.model.model_copy(update={"make_vocab_size_divisible_by": 192})
    tensor_parallel = cfg.model_copy(update={"model": padded_per_rank,
                                             "parallel": cfg.parallel.model_copy(update={"tensor": 2})})
    _check_same_vocabulary(cfg, tensor_parallel, checkpoint)  # 384 rows at TP=2

    # a megadiff export keeps its run's config (the sidecar's): its tokenizer's vocabulary, padded further
    exported = convert_to_hf(checkpoint, tmp_path / "export")
    capsys.readouterr()
    again = convert_from_hf(exported, tmp_path / "again", pad_vocab=256)
    assert "does not describe" not in capsys.readouterr().out
    model = checkpoint_config(again).model
    assert (model.vocab_size, model.make_vocab_size_divisible_by) == (301, 512)
    padded = load_checkpoint(again).parameters_by_name()["output_layer.weight"]
    assert padded.shape[0] == 512 and torch.equal(padded[:384], weights["output_layer.weight"])
    with pytest.raises(SystemExit, match="2"):
        main(["convert", "from-hf", "--load", str(tmp_path / "odd"), "--save", str(tmp_path / "x"), "--pad-vocab", "0"])
    assert "--pad-vocab: 0 is not >= 1" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="--pad-vocab must be >= 1"):
        convert_from_hf(tmp_path / "odd", tmp_path / "x", pad_vocab=0)


def test_a_vocabulary_that_needs_no_padding_is_not_copied():
    """The largest matrices of a 13B conversion: padding them is a copy, which an unpadded one skips."""
    from megadiff.convert.from_hf import _with_padded_vocab

    embedding, head = torch.randn(8, 4), torch.randn(8, 4)
    [part] = _with_padded_vocab([{"embedding.word_embeddings.weight": embedding, "output_layer.weight": head}], 8)
    assert part["embedding.word_embeddings.weight"] is embedding and part["output_layer.weight"] is head


def test_an_export_names_its_tokenizers_bos_and_its_rope_base_for_every_transformers(tmp_path):
    """A Llama-family tokenizer begins texts with a BOS of its own (not the EOS); transformers 4.x reads the
    RoPE base from config.json's rope_theta alone, and took 10000 silently without it."""
    import json

    stock_llama(tmp_path / "llama", tied=False, bos="<s>")
    exported = convert_to_hf(convert_from_hf(tmp_path / "llama", tmp_path / "megadiff"), tmp_path / "back")
    config = json.loads((exported / "config.json").read_text())
    generation = json.loads((exported / "generation_config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], generation["bos_token_id"]) == (1, 0, 1)
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 500.0


@pytest.mark.parametrize("change, message", [
    ("base", r"no tensor model.embed_tokens.weight .* \(LlamaModel, not LlamaForCausalLM\)"),
    ("other_head", r"config.json ties the embeddings .* lm_head.weight differs from model.embed_tokens.weight"),
])
def test_weights_that_are_not_the_configs_causal_lm_are_refused_by_name(tmp_path, change, message):
    from safetensors.torch import save_file

    stock_llama(tmp_path / "llama", tied=change == "other_head")
    weights = tmp_path / "llama" / "model.safetensors"
    state = load_file(str(weights))
    if change == "base":  # what LlamaModel.save_pretrained writes: no head, no "model." prefix
        state = {name.removeprefix("model."): tensor for name, tensor in state.items() if name != "lm_head.weight"}
    else:  # a tied config beside a separate head, which transformers then uses
        state["lm_head.weight"] = torch.randn_like(state["model.embed_tokens.weight"])
    save_file(state, str(weights), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)


@pytest.mark.parametrize("damage, message", [
    (lambda directory: _cut_short(directory / "model.safetensors"), r"model.safetensors cannot be read \(.*cut short"),
    (lambda directory: (directory / "config.json").write_text("{"), r"config.json is not JSON"),
], ids=["weights cut short", "config not JSON"])
def test_a_damaged_model_directory_is_refused_by_name(tmp_path, damage, message):
    stock_llama(tmp_path / "llama", tied=True)
    damage(tmp_path / "llama")
    with pytest.raises(ConversionError, match=message):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)


def _cut_short(path) -> None:
    path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])


def test_rotary_buffers_of_older_exports_are_left_behind(tmp_path):
    """transformers before 4.31 saved each layer's rotary_emb.inv_freq; it ignores them on load, so does from-hf."""
    from safetensors.torch import save_file

    llama = stock_llama(tmp_path / "llama", tied=False)
    weights = tmp_path / "llama" / "model.safetensors"
    state = load_file(str(weights))
    inv_freq = llama.model.rotary_emb.inv_freq
    state.update({f"model.layers.{i}.self_attn.rotary_emb.inv_freq": inv_freq.clone() for i in range(2)})
    save_file(state, str(weights), metadata={"format": "pt"})
    ours = load_checkpoint(convert_from_hf(tmp_path / "llama", tmp_path / "megadiff"))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)


def _save_pytorch_shards(state: dict, directory, shards: int) -> None:
    """pytorch_model-0000i-of-0000n.bin files and their index, as transformers 4 saved a model's weights."""
    import json

    names, weight_map = sorted(state), {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        torch.save({name: state[name] for name in names[i::shards]}, directory / file)
        weight_map.update(dict.fromkeys(names[i::shards], file))
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["shards", "pytorch_model.bin", "pytorch_model.bin before torch 1.6",
                                    "pytorch_model.bin shards"])
def test_weights_in_shards_or_a_pytorch_file_are_read(tmp_path, layout):
    """from-hf reads tensors from their files one layer at a time: through a shard index, and from a
    memory-mapped pytorch_model.bin (read whole in the format of torch before 1.6), or its shards (refused as no
    weights: many a Llama 2 fine-tune has no others)."""
    llama = stock_llama(tmp_path / "llama", tied=False)
    weights = tmp_path / "llama" / "model.safetensors"
    state = load_file(str(weights))
    weights.unlink()
    if layout == "shards":
        llama.save_pretrained(tmp_path / "llama", max_shard_size="40KB")
        assert len(list((tmp_path / "llama").glob("model-*-of-*.safetensors"))) > 2
    elif layout == "pytorch_model.bin shards":  # as transformers 4 wrote them (5 writes safetensors alone)
        _save_pytorch_shards(state, tmp_path / "llama", shards=3)
    else:  # torch.save's format before torch 1.6 cannot be memory-mapped
        torch.save(state, tmp_path / "llama" / "pytorch_model.bin",
                   _use_new_zipfile_serialization=layout == "pytorch_model.bin")
    ours = load_checkpoint(convert_from_hf(tmp_path / "llama", tmp_path / "megadiff"))
    ids = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)


def test_a_rope_base_megatron_cannot_hold_is_refused_by_name(tmp_path):
    stock_llama(tmp_path / "llama", tied=False, rope_theta=10000.5)
    with pytest.raises(ConfigError, match=r"model.rope_theta: 10000.5 must be an integer"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff")


def test_tokens_added_to_a_tiktoken_export_come_back_with_it(tmp_path):
    """An export's sidecar names its packaged encoding (cl100k_base), which from-hf keeps by name; tokens added to
    the export's tokenizer for fine-tuning (ChatML's, in the padded rows) were then read as text."""
    from transformers import AutoTokenizer, GenerationConfig, pipeline

    from tests.convert_worker import LAYOUTS, MODEL, VARIANTS, save_in_process

    cfg = build_config({}, MODEL + VARIANTS["softmax"] + LAYOUTS["single"] + [
        "data.tokenizer=cl100k_base", "model.vocab_size=100352", "model.make_vocab_size_divisible_by=128"])
    save_in_process(cfg, tmp_path / "checkpoint")
    export = convert_to_hf(tmp_path / "checkpoint", tmp_path / "hf")
    assert checkpoint_config(convert_from_hf(export, tmp_path / "as-exported")).data.tokenizer == "cl100k_base"
    hf_tokenizer = AutoTokenizer.from_pretrained(export)
    # batched pipelines pad with a reserved id (tiktoken never gives it; the EOS would leave fine-tuning labels)
    # and truncation cuts at the model's context
    assert hf_tokenizer.pad_token_id == GenerationConfig.from_pretrained(export).pad_token_id == 100256
    assert hf_tokenizer.model_max_length == cfg.model.seq_length
    prompts = ["In the beginning God created", "And the earth was"]
    generate = pipeline("text-generation", model=str(export), do_sample=False, max_new_tokens=4)
    assert generate(prompts, batch_size=2) == [generate(prompt) for prompt in prompts]
    hf_tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf_tokenizer.save_pretrained(export)
    back = checkpoint_config(convert_from_hf(export, tmp_path / "back")).data.tokenizer
    assert back == str((tmp_path / "back" / "tokenizer").resolve())
    assert load_tokenizer(back).vocab_size == len(hf_tokenizer) == 100279


def test_a_tokenizer_with_ids_beyond_the_embedding_is_refused_unless_the_rows_are_padded(tmp_path):
    """Tokens added to a Llama's tokenizer without resize_token_embeddings (a pad token, in many fine-tunes): the
    conversion wrote a checkpoint that every loader then refused as holding another model's tokenizer, and its
    check drew ids the Hugging Face model has no row for. --pad-vocab gives them rows."""
    from transformers import AutoTokenizer

    llama = stock_llama(tmp_path / "llama", tied=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    tokenizer.add_special_tokens({"pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match="its tokenizer has 302 ids, but the model embeds 300 "):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff")
    assert not (tmp_path / "megadiff").exists()

    checkpoint = convert_from_hf(tmp_path / "llama", tmp_path / "padded", pad_vocab=128)
    ours = load_checkpoint(checkpoint)
    assert ours.tokenizer.vocab_size == 302 and ours.vocab_size == 384
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids)[..., :300], llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)


def test_a_tokenizer_naming_no_eos_is_refused_before_anything_is_written(tmp_path):
    """A tokenizer whose EOS only config.json names: the conversion passed its check and wrote a checkpoint that
    pre-training, generation and load_checkpoint then refused, each needing the EOS to end documents."""
    from transformers import AutoTokenizer

    stock_llama(tmp_path / "llama", tied=False)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "llama")
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path / "llama")
    with pytest.raises(ConversionError, match=r"has no eos token .* config.json's eos_token_id is 0"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff")
    assert not (tmp_path / "megadiff").exists()


def test_weights_in_a_precision_megadiff_does_not_train_need_dtype_and_convert_with_it(tmp_path):
    """float64 weights (a research checkpoint) name the option that converts them, rather than failing as a
    missing precision deep in the conversion."""
    from safetensors.torch import save_file

    llama = stock_llama(tmp_path / "llama", tied=False)
    weights = tmp_path / "llama" / "model.safetensors"
    save_file({name: t.double() for name, t in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=r"weights in torch.float64; pass --dtype fp32, bf16 or fp16"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)
    assert not (tmp_path / "megadiff").exists()
    checkpoint = convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="fp32", check=False)
    assert checkpoint_config(checkpoint).train.precision == "fp32"
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(checkpoint)(ids), llama(input_ids=ids).logits, rtol=1e-4, atol=2e-5)


def _edit_weights(directory, edit) -> None:
    from safetensors.torch import save_file

    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    edit(tensors)
    save_file(tensors, str(weights), metadata={"format": "pt"})


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_a_weight_the_dtype_cannot_hold_is_named_and_nothing_is_written(tmp_path, check):
    """fp16 holds at most 65,504: a larger weight became inf, and the checkpoint's logits NaN."""
    stock_llama(tmp_path / "llama", tied=False)
    _edit_weights(tmp_path / "llama", lambda tensors: tensors["model.embed_tokens.weight"][7].fill_(1e5))
    with pytest.raises(ConversionError, match=r"embedding.word_embeddings.weight: values up to 1e\+05 overflow "
                                              r"torch.float16 \(whose largest is 6.55e\+04\): convert with --dtype"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="fp16", check=check)
    assert not (tmp_path / "megadiff").exists()
    convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="bf16", check=check)


def test_a_source_weight_already_not_finite_is_not_called_an_overflow(tmp_path):
    """A NaN in the Hugging Face weights is the model's, not the dtype's: --dtype bf16 or fp32 would not help."""
    stock_llama(tmp_path / "llama", tied=False)
    _edit_weights(tmp_path / "llama", lambda tensors: tensors["model.norm.weight"][0].fill_(float("nan")))
    with pytest.raises(ConversionError, match=r"check failed: the \w+ logits are not finite") as refused:
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="fp16")
    assert "overflow" not in str(refused.value)


def test_the_check_runs_on_the_weights_the_dtype_rounded(tmp_path):
    """The check compares the model the checkpoint holds: final-norm weights of 1e-9, fp16's zero, leave every
    logit 0 and every argmax the first id. Checked before the rounding, the conversion passed."""
    stock_llama(tmp_path / "llama", tied=False)
    _edit_weights(tmp_path / "llama", lambda tensors: tensors["model.norm.weight"].fill_(1e-9))
    with pytest.raises(ConversionError, match=r"check failed: .* top-1 agreement \d"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="fp16")
    assert not (tmp_path / "megadiff").exists()
    convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", dtype="bf16")  # bf16 keeps 1e-9


def test_a_model_saved_without_its_tokenizer_is_refused_in_those_words(tmp_path):
    stock_llama(tmp_path / "llama", tied=False)
    for path in (tmp_path / "llama").iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            path.unlink()
    with pytest.raises(ConversionError, match=r"llama: no usable tokenizer files \(it holds none of tokenizer.json, "
                                              r".*save the model's tokenizer there"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)


def test_from_hf_refuses_a_directory_that_holds_files_and_leaves_them(tmp_path):
    stock_llama(tmp_path / "llama", tied=False)
    (tmp_path / "megadiff").mkdir()
    (tmp_path / "megadiff" / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match=r"megadiff is not empty; from-hf writes a new checkpoint directory"):
        convert_from_hf(tmp_path / "llama", tmp_path / "megadiff", check=False)
    assert [p.name for p in (tmp_path / "megadiff").iterdir()] == ["notes.txt"]
    assert (tmp_path / "megadiff" / "notes.txt").read_text() == "mine"
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConversionError, match=r"notes.txt is a file; from-hf writes a new checkpoint directory"):
        convert_from_hf(tmp_path / "llama", tmp_path / "notes.txt", check=False)
    with pytest.raises(ConversionError, match=r"notes.txt/sub lies under .*notes.txt, a file; from-hf writes"):
        convert_from_hf(tmp_path / "llama", tmp_path / "notes.txt" / "sub", check=False)  # before the conversion
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_chat_runs_export_stops_generating_at_the_end_of_a_turn(tmp_path):
    """transformers' generate() stops at the generation config's EOS ids: a chat-tuned export must list its
    template's end of turn (ChatML's <|im_end|>, one special token here), or a reply runs on into made-up turns."""
    from pathlib import Path

    from transformers import GenerationConfig

    from megadiff.convert.hf_io import _generation_config

    directory = build_tokenizer(tmp_path / "tok", bos="<|im_end|>")
    tokenizer = load_tokenizer(str(directory))
    chatml = Path(__file__).resolve().parents[1] / "configs" / "chat" / "chatml.jinja"
    plain = build_config({}, [f"data.tokenizer={directory}"])
    chat = build_config({}, [f"data.tokenizer={directory}", "data.messages_key=messages", f"data.chat_template={chatml}"])
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert end != tokenizer.eod
    assert _generation_config(GenerationConfig(eos_token_id=tokenizer.eod), tokenizer, chat).eos_token_id == \
        [tokenizer.eod, end]
    assert _generation_config(GenerationConfig(eos_token_id=tokenizer.eod), tokenizer, plain).eos_token_id == \
        tokenizer.eod


@pytest.mark.parametrize("listed_in", ["generation_config.json", "config.json"])
def test_generation_stops_at_every_eos_the_models_generation_config_names(tmp_path, capsys, listed_in):
    """A Llama 3 Instruct's generate() stops at several EOS ids (its generation config lists <|end_of_text|>
    beside its tokenizer's <|eot_id|>; older directories list them in config.json alone). After from-hf, megadiff
    stopped at the tokenizer's EOS alone, running on past <|end_of_text|>, and so did transformers on the
    checkpoint's export, whose list had lost it."""
    from transformers import AutoTokenizer, GenerationConfig

    from megadiff.inference.generate import generate_cli

    source, new_tokens = tmp_path / "llama", 12
    llama = stock_llama(source, tied=False, bos="<|end_of_text|>")
    hf_tokenizer = AutoTokenizer.from_pretrained(source)
    end_of_text = hf_tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    assert end_of_text != hf_tokenizer.eos_token_id
    prompt = TEXT[:40]
    ids = hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():  # <|end_of_text|> made likelier than the third greedy token, wherever that is positive
        third = int(llama.generate(ids, max_new_tokens=3, do_sample=False, eos_token_id=None)[0, -1])
        llama.lm_head.weight[end_of_text] = 2 * llama.lm_head.weight[third]
    eos = [end_of_text, hf_tokenizer.eos_token_id]
    if listed_in == "config.json":
        llama.config.eos_token_id = eos
        llama.save_pretrained(source)
        (source / "generation_config.json").unlink()
    else:
        llama.save_pretrained(source)
        GenerationConfig(bos_token_id=end_of_text, eos_token_id=eos).save_pretrained(source)

    def transformers_reply(directory) -> list[int]:
        model = AutoModelForCausalLM.from_pretrained(directory)
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=new_tokens, do_sample=False)[0, ids.shape[1]:].tolist()

    expected = transformers_reply(source)
    assert expected[-1] == end_of_text and len(expected) < new_tokens  # it stopped there
    checkpoint = convert_from_hf(source, tmp_path / "megadiff")
    capsys.readouterr()
    generate_cli(str(checkpoint), prompt, max_new_tokens=new_tokens)
    assert capsys.readouterr().out == prompt + hf_tokenizer.decode(expected[:-1]) + "\n"
    assert transformers_reply(convert_to_hf(checkpoint, tmp_path / "back")) == expected
