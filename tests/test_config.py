"""Config tree: YAML + overrides, and bad configs refused before any compute, naming the key."""
from __future__ import annotations

import re

import pytest
import torch
import yaml

from megadiff.config import ConfigError, build_config, load_config, resolved_head_dim


def test_yaml_base_inheritance_and_overrides(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  hidden_size: 128\n  num_attention_heads: 4\ntrain:\n  lr: 0.1\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nmodel:\n  num_layers: 3\n")
    cfg = load_config(tmp_path / "child.yaml", ["train.lr=0.5", "output_dir=/tmp/x"])
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.train.lr, cfg.output_dir) == (128, 3, 0.5, "/tmp/x")
    assert resolved_head_dim(cfg.model) == 16  # DIFF: hidden / (2 heads-maps x 4 heads)


def test_files_inheriting_from_each_other_are_refused(tmp_path):
    """Followed without a check, a loop of bases recursed until Python's stack overflowed."""
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: sub/../a.yaml\n")
    with pytest.raises(ConfigError, match=f"base: circular inheritance through {tmp_path / 'a.yaml'}"):
        load_config(tmp_path / "a.yaml")


@pytest.mark.parametrize("override,expected", [
    ("train.warmup_iters=5", "train.warmup_iters: unknown key (did you mean train.lr_warmup_iters?)"),
    ("model.hiden_size=3", "model.hiden_size: unknown key (did you mean model.hidden_size?)"),
    ("trian.lr=1", "trian: unknown key (did you mean train?)"),
    ("outputdir=runs/x", "outputdir: unknown key (did you mean output_dir?)"),
    ("logging.wandb_projet=x", "logging.wandb_projet: unknown key (did you mean logging.wandb_project?)"),
    ("model.xyz=1", "model.xyz: unknown key"),
])
def test_a_misspelt_key_is_refused_with_the_key_of_its_section_spelt_most_like_it(override, expected):
    """Each suggestion is a key of the section named; a key like none of them gets none."""
    with pytest.raises(ConfigError) as refusal:
        build_config({}, [override])
    assert str(refusal.value).splitlines()[1].strip() == expected


def test_softmax_head_dim_uses_all_heads():
    cfg = build_config({}, ["model.variant=softmax", "model.hidden_size=128", "model.num_attention_heads=4"])
    assert resolved_head_dim(cfg.model) == 32


@pytest.mark.parametrize("overrides,key", [
    (["model.hiden_size=3"], "model.hiden_size: unknown key"),
    (["train.lr=abc"], "train.lr"),
    (["model.hidden_size=65"], "model.hidden_size"),
    (["model.num_attention_heads=4", "model.num_kv_heads=3", "model.hidden_size=64"], "model.num_kv_heads"),
    (["parallel.tensor=4"], "parallel.tensor"),
    (["model.num_attention_heads=6", "model.hidden_size=96", "parallel.tensor=4"],
     "parallel.tensor: model.num_attention_heads \\(6\\) is not divisible by the tensor-parallel size 4"),
    (["model.ffn_hidden_size=131", "parallel.tensor=2"],
     "parallel.tensor: the FFN width \\(131, model.ffn_hidden_size\\) is not divisible"),
    (["model.num_layers=4", "parallel.virtual_pipeline=2"],
     "parallel.virtual_pipeline: interleaving needs parallel.pipeline >= 2"),
    (["model.num_attention_heads=4", "model.num_kv_heads=1", "model.hidden_size=64", "parallel.tensor=2"],
     "GQA groups"),
    (["model.num_layers=3", "parallel.pipeline=2"], "parallel.pipeline"),
    (["model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=4"], "parallel.pipeline"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel: needs parallel.tensor"),
    (["parallel.tensor=2", "parallel.sequence_parallel=true", "model.seq_length=33"], "not divisible by parallel"),
    (["model.num_attention_heads=4", "parallel.tensor=4", "parallel.context=2", "parallel.sequence_parallel=true",
      "model.seq_length=12"], "parallel.sequence_parallel: each context rank's 6 positions are not divisible"),
    (["model.variant=shared_diff"], "model.lowrank_rank"),
    (["model.lowrank_rank=8"], "model.lowrank_rank"),
    (["model.variant=softmax", "model.lambda_init=0.5"], "model.lambda_init"),
    (["model.lambda_init=1.0"], "model.lambda_init: 1.0 must be in \\[0, 1\\)"),
    (["model.lambda_init=-0.1"], "model.lambda_init: -0.1 must be in"),
    (["model.lambda_init=true"], "model.lambda_init: a number is expected, not true or false"),
    (["model.num_layers=true"], "model.num_layers: a number is expected, not true or false"),
    (["logging.profile_ranks=[true]"], "logging.profile_ranks: a number is expected"),
    (["train.recompute=false"], "train.recompute: Input should be 'none', 'selective' or 'full'"),
    (["train.lr=.inf"], "train.lr: Input should be a finite number"),
    (["model.init_std=.inf"], "model.init_std: Input should be a finite number"),
    (["train.seed=-1"], "train.seed"),
    (["train.seed=4294967200", "model.num_layers=2", "parallel.pipeline=2"],
     "train.seed: 4294967200 \\+ 100 per pipeline stage reaches 4294967300"),
    (["train.lr_warmup_iters=10", "train.lr_decay_iters=10"], "train.lr_decay_iters: 10 ends the decay before"),
    (["model.head_dim=7"], "model.head_dim"),
    (["train.min_lr=1", "train.lr=0.1"], "train.min_lr"),
    (["train.lr_decay_style=wsd"], "train.lr_wsd_decay_iters: train.lr_decay_style=wsd needs"),
    (["train.lr_decay_style=wsd", "train.iters=100", "train.lr_warmup_iters=10", "train.lr_wsd_decay_iters=91"],
     "train.lr_wsd_decay_iters: 91 is longer than the schedule after its warmup \\(90"),
    (["train.lr_decay_style=wsd", "train.iters=4", "train.lr_warmup_iters=10", "train.lr_wsd_decay_iters=2"],
     "train.lr_wsd_decay_iters: train.lr_warmup_iters \\(10\\) leaves no iteration of train.iters \\(4\\)"),
    (["train.lr_wsd_decay_iters=10"], "train.lr_wsd_decay_iters: only used with train.lr_decay_style=wsd"),
    (["train.spike_window=1"], "train.spike_window"),
    (["train.precision=fp8"], "train.precision"),
    (["train.precision=fp8", "model.seq_length=100"], "train.micro_batch_size: fp8 matmuls need the tokens of a "
     "micro-batch on a rank \\(model.seq_length x train.micro_batch_size / parallel.context = 100\\)"),
    (["train.precision=fp8", "model.seq_length=100", "train.micro_batch_size=4", "parallel.context=2"],
     "train.micro_batch_size: .* = 200\\)"),
    (["train.precision=fp8", "model.hidden_size=1000", "model.num_attention_heads=5", "model.ffn_hidden_size=2010",
      "parallel.tensor=5"], "train.precision: fp8 matmuls need widths that are multiples of 16: model.hidden_size "
     "\\(1000\\), the attention output's per-rank width \\(200\\), model.ffn_hidden_size per rank \\(402\\), "
     "the QKV projection's per-rank width \\(600\\) are not"),
    (["train.precision=fp8", "model.ffn_hidden_size=5000", "parallel.tensor=2"],
     "train.precision: .*: model.ffn_hidden_size per rank \\(2500\\) is not \\(with parallel.tensor=2\\)"),
    (["parallel.overlap_param_gather=true"], "parallel.overlap_param_gather"),
    (["checkpoint.optimizer_format=parallel"], "checkpoint.optimizer_format: .* needs parallel.distributed_optimizer"),
    (["checkpoint.optimizer_format=sharded"], "checkpoint.optimizer_format"),
    (["model.transformer_impl=te"], "model.transformer_impl"),
    (["model.sdpa_kernels=[flash,math,flash]"], "model.sdpa_kernels: .*names a kernel twice"),
    (["model.sdpa_kernels=[]"], "model.sdpa_kernels"),
    (["model.sdpa_kernels=[fa3]"], "model.sdpa_kernels.*'cudnn', 'flash', 'efficient' or 'math'"),
    (["model.attention_backend=triton", "model.sdpa_kernels=[cudnn]"],
     "model.sdpa_kernels: model.attention_backend=triton makes no SDPA call"),
    (["model.attention_backend=reference", "model.sdpa_kernels=[cudnn]"],
     "model.sdpa_kernels: model.attention_backend=reference makes no SDPA call"),
    (["logging.profile_iterations=[3,2]"], "logging.profile_iterations"),
    (["logging.profile_iterations=[0,2]"], "logging.profile_iterations"),
    (["logging.profile_ranks=[-1]"], "logging.profile_ranks"),
    (["train.eval_interval=5", "data.split=100,0,0"], "train.eval_interval: data.split '100,0,0' leaves no valid"),
    (["train.eval_interval=5", "data.split=100,0"], "train.eval_interval"),
    (["train.eval_interval=null", "train.eval_each_source=true"], "train.eval_each_source: needs"),
    (["data.bundled_corpus=kjv", "data.sources=[a.txt]"], "data.bundled_corpus: set either"),
    (["data.prefix=data/prepared/"], "data.prefix: 'data/prepared/' names no files: a prefix is a path less"),
    (["data.blend=[1.0,data/a,1.0,data/b/]"], "data.blend: 'data/b/' names no files"),
    (["data.prefix=' '"], "data.prefix: ' ' names no files"),
    (["data.length_upsampling_unit=4096"], "data.length_upsampling_unit: only used with data.length_upsampling"),
    (["data.response_key=response", "data.messages_key=messages"], "data.messages_key: set either"),
    (["data.response_key=response", "data.length_upsampling=true"], "are not up-sampled by length"),
    (["data.messages_key=messages", "data.length_upsampling=true"], "are not up-sampled by length"),
    (["model.num_attention_heads=4", "parallel.context=2", "model.seq_length=18"],
     "parallel.context: sequence length 18 is not divisible by 2 x parallel.context \\(4\\)"),
])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        build_config({}, overrides)


def test_booleans_and_strings_still_reach_the_fields_that_take_them():
    cfg = build_config({}, ["model.tie_embeddings=true", "model.lambda_init=depth", "train.iters=1e3",
                            "model.lambda_init=0"])
    assert (cfg.model.tie_embeddings, cfg.model.lambda_init, cfg.train.iters) == (True, 0.0, 1000)


def test_a_warmup_outlasting_the_run_is_said_not_refused():
    """A recipe shortened for a trial keeps its warmup: the run starts, saying how far its lr rises."""
    from megadiff.config import short_warmup_warning

    assert short_warmup_warning(build_config({}, ["train.iters=100", "train.lr_warmup_iters=100"]).train) is None
    trial = build_config({}, ["train.iters=100", "train.lr_warmup_iters=1000", "train.lr=3.2e-4"]).train
    assert short_warmup_warning(trial) == ("train.lr_warmup_iters: 1000 iterations of warmup outlast train.iters=100: "
                                           "the lr rises to 3.2e-05, never to train.lr=0.00032")


def test_document_masking_refuses_tes_softmax_attention(monkeypatch):
    import importlib.util
    find_spec = importlib.util.find_spec  # as if TransformerEngine were installed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: find_spec("torch") if name ==
                        "transformer_engine" else find_spec(name, *a))
    overrides = ["data.document_masking=true", "model.transformer_impl=te"]
    build_config({}, overrides + ["model.variant=diff"])  # the differential core attention is ours
    with pytest.raises(ConfigError, match="data.document_masking: the softmax baseline"):
        build_config({}, overrides + ["model.variant=softmax"])
    kernels = ["model.sdpa_kernels=[cudnn,flash]", "model.transformer_impl=te"]
    build_config({}, kernels + ["model.variant=diff", "model.attention_backend=sdpa"])
    with pytest.raises(ConfigError, match="model.sdpa_kernels: the softmax baseline .* runs TE's attention"):
        build_config({}, kernels + ["model.variant=softmax"])


def test_world_size_checks():
    with pytest.raises(ConfigError, match="world size 3"):
        build_config({}, ["parallel.tensor=2"], world_size=3)
    with pytest.raises(ConfigError, match="train.global_batch_size"):
        build_config({}, ["train.global_batch_size=3", "train.micro_batch_size=1"], world_size=2)
    with pytest.raises(ConfigError, match=r"logging.profile_ranks: \[2\] are not ranks"):
        build_config({}, ["logging.profile_ranks=[0,2]", "train.global_batch_size=2"], world_size=2)


def test_the_interleaved_schedule_needs_micro_batches_in_multiples_of_the_pipeline():
    interleaved = ["model.num_layers=4", "parallel.pipeline=2", "parallel.virtual_pipeline=2",
                   "train.micro_batch_size=1"]
    build_config({}, interleaved + ["train.global_batch_size=4"], world_size=2)  # one data rank: 4 micro-batches
    with pytest.raises(ConfigError, match=r"train.global_batch_size: the interleaved schedule needs the number of "
                                          r"micro-batches \(3\) to be a multiple of parallel.pipeline \(2\)"):
        build_config({}, interleaved + ["train.global_batch_size=3"], world_size=2)
    with pytest.raises(ConfigError, match=r"micro-batches \(3\)"):  # two data ranks share 6 samples
        build_config({}, interleaved + ["train.global_batch_size=6"], world_size=4)


def test_the_bounds_of_the_checks_are_accepted():
    build_config({}, ["train.min_lr=1e-3", "train.lr=1e-3"])
    build_config({}, ["train.lr_decay_style=wsd", "train.iters=100", "train.lr_warmup_iters=10",
                      "train.lr_wsd_decay_iters=90"])
    build_config({}, ["model.num_attention_heads=4", "parallel.context=2", "model.seq_length=20"])
    build_config({}, ["data.bundled_corpus=null", "data.sources=[a.txt]"])


def test_override_without_equals_is_refused():
    with pytest.raises(ConfigError, match="key.sub=value"):
        build_config({}, ["train.lr"])


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_checkpoint_configs_with_retired_keys_still_load(tmp_path):
    from megadiff.checkpoint.format import checkpoint_config
    from megadiff.config import dump_config

    dump_config(build_config({}, ["model.num_layers=3"]), tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    saved["logging"]["rank0_only"] = True  # what checkpoints written before its removal hold
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert checkpoint_config(tmp_path).model.num_layers == 3
    saved["logging"]["no_such_key"] = 1  # anything else unknown is still an error
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="logging.no_such_key: unknown key"):
        checkpoint_config(tmp_path)


def test_a_bad_triton_candidates_limit_is_refused_before_the_run_starts(monkeypatch, capsys):
    """$MEGADIFF_TRITON_CANDIDATES is read by the kernel's autotuner at the first step, after the model and
    data are built (minutes at scale): `pretrain` refuses a bad one as it reads its config."""
    import megadiff.training.pretrain as pretrain
    from megadiff.cli import main
    from tests.pretrain_runs import DEMO_CONFIG

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg: pytest.fail("the run started"))
    monkeypatch.setenv("MEGADIFF_TRITON_CANDIDATES", "all")
    assert main(["pretrain", str(DEMO_CONFIG)]) == 2
    assert "$MEGADIFF_TRITON_CANDIDATES must be a positive integer, got 'all'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_the_triton_backend_without_a_gpu_is_refused_before_the_run_starts(monkeypatch, capsys):
    """Not at the first step, after the model and data are built."""
    pytest.importorskip("triton")  # without it the refusal names the missing package instead
    import megadiff.training.pretrain as pretrain
    from megadiff.cli import main
    from tests.pretrain_runs import DEMO_CONFIG

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg: pytest.fail("the run started"))
    assert main(["pretrain", str(DEMO_CONFIG), "model.attention_backend=triton"]) == 2
    assert "model.attention_backend: 'triton' cannot run here: the kernel needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_sdpa_kernels_that_cannot_run_on_a_cpu_are_refused_before_the_run_starts(monkeypatch, capsys):
    import megadiff.training.pretrain as pretrain
    from megadiff.cli import main
    from tests.pretrain_runs import DEMO_CONFIG

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg: pytest.fail("the run started"))
    # the demo's DIFF model: V twice as wide as Q and K, which CPU flash does not take
    assert main(["pretrain", str(DEMO_CONFIG), "model.sdpa_kernels=[cudnn,flash]"]) == 2
    said = capsys.readouterr().err
    assert "model.sdpa_kernels: none of ['cudnn', 'flash'] takes this model's attention calls here; torch says: " \
           "Flash attention requires q,k,v to have the same last dimension" in said, said
    assert main(["pretrain", str(DEMO_CONFIG), "model.variant=softmax", "model.sdpa_kernels=[efficient]"]) == 2
    assert "model.sdpa_kernels: none of ['efficient']" in capsys.readouterr().err
    started = []
    monkeypatch.setattr(pretrain, "pretrain", lambda cfg: started.append(cfg.model.sdpa_kernels) or 0)
    for kernels, overrides in (("[cudnn,math]", []), ("[flash]", ["model.attention_backend=sdpa_split_v"]),
                               ("[flash]", ["model.variant=softmax"])):
        assert main(["pretrain", str(DEMO_CONFIG), f"model.sdpa_kernels={kernels}", *overrides]) == 0
    assert started == [["cudnn", "math"], ["flash"], ["flash"]]


def test_an_output_dir_that_is_a_file_is_refused_before_the_run_starts(monkeypatch, capsys, tmp_path):
    import megadiff.training.pretrain as pretrain
    from megadiff.cli import main
    from tests.pretrain_runs import DEMO_CONFIG

    monkeypatch.setattr(pretrain, "pretrain", lambda cfg: pytest.fail("the run started"))
    (tmp_path / "run").write_text("a file where the run would go")
    assert main(["pretrain", str(DEMO_CONFIG), f"output_dir={tmp_path / 'run'}"]) == 2
    assert f"output_dir: {tmp_path / 'run'} is a file" in capsys.readouterr().err
    assert main(["pretrain", str(DEMO_CONFIG), f"output_dir={tmp_path / 'run' / 'sub'}"]) == 2
    assert f"output_dir: {tmp_path / 'run' / 'sub'} lies under {tmp_path / 'run'}, a file" in capsys.readouterr().err


def test_the_sdpa_kernels_check_asks_for_training_calls_of_the_models_shapes(monkeypatch):
    """What torch's dispatcher is asked: inputs needing gradients (some kernels' backward limits, e.g. cuDNN's
    at V 256 wide, refuse only those), one rank's heads, V as wide as the backend makes it, a mask under
    context parallelism, and one-token calls under document masking."""
    from megadiff.models import sdpa_calls

    asked = []

    def choice(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
        asked.append(dict(grad=torch.is_grad_enabled() and q.requires_grad and v.requires_grad,
                          heads=(q.shape[1], k.shape[1], v.shape[1]), widths=(q.shape[-1], v.shape[-1]),
                          lengths=(q.shape[2], k.shape[2]), masked=attn_mask is not None, gqa=enable_gqa))
        return 0

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    cpu = torch.device("cpu")
    model = ["model.hidden_size=256", "model.num_attention_heads=4", "model.num_kv_heads=2", "model.head_dim=32",
             "model.sdpa_kernels=[math]"]
    with torch.no_grad():  # the check asks for training calls wherever it is run from
        assert sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model + ["parallel.tensor=2"], 2), cpu) is None
    assert asked == [dict(grad=True, heads=(2, 1, 1), widths=(32, 64), lengths=(64, 64), masked=False, gqa=True)]
    asked.clear()
    # every differential variant's V is twice as wide; without grouped queries, no GQA
    for variant in (["model.variant=dint"], ["model.variant=shared_diff", "model.lowrank_rank=4"]):
        sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model + variant), cpu)
    sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model + ["model.num_kv_heads=4"]), cpu)
    assert [(a["heads"], a["widths"], a["gqa"]) for a in asked] == [((4, 2, 2), (32, 64), True)] * 2 + \
        [((4, 4, 4), (32, 64), False)]
    asked.clear()
    sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model + ["model.attention_backend=sdpa_split_v",
                                                                  "parallel.context=2", "data.document_masking=true"],
                                                     2), cpu)
    assert [(a["widths"], a["lengths"], a["masked"]) for a in asked] == [((32, 32), (64, 128), True),
                                                                         ((32, 32), (1, 1), False)]
    asked.clear()
    assert sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model[:-1]), cpu) is None and asked == []

    # where the differential backend resolves to the fused kernel (auto on CUDA), no SDPA call is made
    resolved = []
    monkeypatch.setattr(sdpa_calls, "resolve_backend", lambda backend, q, value_dim: resolved.append(
        (backend, q.shape[-1], value_dim)) or "triton")
    assert sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model), cpu) is None and asked == []
    assert resolved == [("auto", 32, 64)]


def test_sdpa_kernels_order_the_softmax_baseline_whatever_the_differential_backend_says():
    """model.attention_backend chooses the differential core attention's path; the softmax baseline's is SDPA."""
    cfg = build_config({}, ["model.variant=softmax", "model.attention_backend=triton", "model.sdpa_kernels=[math]"])
    assert cfg.model.sdpa_kernels == ["math"]


def test_a_kernel_list_that_refuses_only_one_token_documents_says_so(monkeypatch):
    """Document masking's one-token calls (which cuDNN, for one, declines) are asked about apart, and a
    refusal of those alone names them."""
    from megadiff.models import sdpa_calls

    def choice(q, k, v, **call):
        if q.shape[2] == 1:
            raise RuntimeError("No available kernel. Aborting execution.")
        return 0

    monkeypatch.setattr(torch, "_fused_sdp_choice", choice)
    model = ["model.sdpa_kernels=[cudnn]", "model.attention_backend=sdpa"]
    assert sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model), torch.device("cpu")) is None
    refusal = sdpa_calls.sdpa_kernels_refusal_for(build_config({}, model + ["data.document_masking=true"]),
                                                  torch.device("cpu"))
    assert refusal.startswith("(a one-token document's call) No available kernel"), refusal


def test_a_home_directory_in_a_path_setting_is_expanded(monkeypatch, tmp_path):
    """The shell leaves `data.cache_dir=~/cache` alone (a word with a dot before its `=`): it wrote ./~/cache,
    while data.sources and data.chat_template were expanded."""
    from megadiff.adapt.settings import FinetuneConfig

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = build_config({}, ["output_dir=~/run", "data.cache_dir=~/cache", "data.prefix=~/p", "checkpoint.load=~/ck",
                            "data.tokenizer=~/tok", "data.sources=[~/a.jsonl, owner/name]", "data.blend=[1, ~/x]"])
    assert (cfg.output_dir, cfg.data.cache_dir, cfg.data.prefix, cfg.checkpoint.load, cfg.data.tokenizer) == tuple(
        str(tmp_path / name) for name in ("run", "cache", "p", "ck", "tok"))
    assert cfg.data.sources == [str(tmp_path / "a.jsonl"), "owner/name"] and cfg.data.blend == [1, str(tmp_path / "x")]
    assert build_config({}, []).data.tokenizer == "cl100k_base"
    adapt = FinetuneConfig.model_validate({
        "model": {"path": "~/base", "tokenizer": "~/tok"}, "data": {"files": ["~/f.jsonl"], "cache_dir": "~/c"},
        "train": {"iters": 1}, "deepspeed": "~/ds.json", "output_dir": "~/out", "export_dir": "~/hf"})
    assert [adapt.model.path, adapt.model.tokenizer, *adapt.data.files, adapt.data.cache_dir, adapt.deepspeed,
            adapt.output_dir, adapt.export_dir] == [str(tmp_path / name) for name in
                                                    ("base", "tok", "f.jsonl", "c", "ds.json", "out", "hf")]


def test_a_chat_template_is_utf8_whatever_the_locale(tmp_path):
    """Read and written as UTF-8 by megadiff's library calls too (the command line runs in UTF-8 mode)."""
    import os
    import subprocess
    import sys

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}«{{ m['content'] }}»{% endfor %}", encoding="utf-8")
    script = ("import sys; from types import SimpleNamespace\nfrom megadiff.config.schema import read_chat_template\n"
              "from megadiff.data.conversations import save_chat_template\n"
              "from megadiff.data.tokenizers import load_tokenizer\ntext = read_chat_template(sys.argv[1])\n"
              "save_chat_template(SimpleNamespace(chat_template=text), load_tokenizer('cl100k_base'), sys.argv[2])\n")
    subprocess.run([sys.executable, "-c", script, str(template), str(tmp_path)], check=True, capture_output=True,
                   env={**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"})
    assert "«{{ m['content'] }}»" in (tmp_path / "chat_template.jinja").read_text(encoding="utf-8")


def test_a_split_of_one_whole_number_is_the_split_it_spells(tmp_path):
    """`split: 100` (megatron's every-document-to-training) is read by YAML as a number: the same split as the
    string, in a file and in an override, and its run's saved config reads back the same."""
    from megadiff.config import dump_config
    from megadiff.config.validate import split_shares

    (tmp_path / "run.yaml").write_text("data:\n  split: 100\n")
    as_string = build_config({}, ["data.split='100'"])
    for cfg in (load_config(tmp_path / "run.yaml"), build_config({}, ["data.split=100"])):
        assert cfg == as_string and split_shares(cfg.data.split) == [100.0, 0.0, 0.0]
    dump_config(as_string, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == as_string


def test_a_shell_s_variable_in_a_config_is_refused_with_the_spelling_that_reads_it(tmp_path, monkeypatch):
    """`${USER}` is another setting of the config to OmegaConf: the refusal gives the environment variable's
    spelling, which then reads the variable; a mistyped setting's name gets no such hint."""
    monkeypatch.setenv("USER", "alice")
    (tmp_path / "run.yaml").write_text("output_dir: /scratch/${USER}/runs\n")
    with pytest.raises(ConfigError) as refusal:
        load_config(tmp_path / "run.yaml")
    spelling = re.search(r"an environment variable is (\$\{oc\.env:USER\})", str(refusal.value)).group(1)
    assert build_config({}, [f"output_dir=/scratch/{spelling}/runs"]).output_dir == "/scratch/alice/runs"
    with pytest.raises(ConfigError) as refusal:
        build_config({}, ["output_dir=${model.varient}"])
    assert "oc.env" not in str(refusal.value)
