"""Tiny models and checkpoints for the conversion and inference tests.

Weights are drawn per global tensor key (tests/parity_worker.layout_independent_weights:
norms and head-norm weights around 1, lambda vectors and every other matrix random), so a
checkpoint saved by TP=2 or PP=2 ranks and a single-process model built here hold the same
tensors."""
from __future__ import annotations

import string
from pathlib import Path

from megatron.core import parallel_state

from megadiff.checkpoint.single_process import CausalLM, build_single_process_model, single_process_config
from megadiff.checkpoint.weights import save_model_weights
from megadiff.config import build_config
from megadiff.models import build_model
from megadiff.parallel import initialize, shutdown
from tests.parity_worker import layout_independent_weights

SEED = 4321
# vocabulary 300: padded to 384 by one process, to 512 under TP=2 (128 x 2)
MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.num_kv_heads=2",
         "model.ffn_hidden_size=96", "model.vocab_size=300", "model.seq_length=32", "model.rope_theta=500",
         "model.attention_backend=sdpa"]
VARIANTS = {
    "softmax": ["model.variant=softmax"],
    "diff": ["model.variant=diff"],
    "dint": ["model.variant=dint"],
    "shared_diff": ["model.variant=shared_diff", "model.lowrank_rank=4", "model.lowrank_zero_init=false"],
    "diff_constant_lambda": ["model.variant=diff", "model.lambda_init=0.8"],
}
LAYOUTS = {"tp2": ["parallel.tensor=2"], "pp2": ["parallel.pipeline=2"], "single": [],
           # interleaved: two model chunks per rank, saved as model0/model1
           "pp2_vpp2": ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4",
                        "train.global_batch_size=2"]}
TEXT = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; "
        "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.")
EOD = "<|endoftext|>"


def build_tokenizer(directory: Path, bos: str | None = None, adds_bos: bool = False,
                    sentencepiece_like: bool = False) -> Path:
    """A byte-level BPE of 300 ids (<|endoftext|> = 0, `bos` = 1 if given) as Hugging Face tokenizer files;
    with `adds_bos` it puts the BOS before every text, as Llama's does; `sentencepiece_like`: words begin
    with "▁" instead, and a text with one of its own (Llama 2's Metaspace, prepend_scheme "first")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    if sentencepiece_like:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = list("▁\n" + string.ascii_letters + string.digits + string.punctuation)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOD] + ([bos] if bos else []),
                                  initial_alphabet=alphabet)
    tokenizer.train_from_iterator([TEXT] * 4, trainer)
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                                 special_tokens=[(bos, 1)])
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOD, bos_token=bos).save_pretrained(str(directory))
    return directory


def variant_config(variant: str, layout: str, tokenizer_dir: str, world_size: int | None = None):
    return build_config({}, MODEL + VARIANTS[variant] + LAYOUTS[layout] + [f"data.tokenizer={tokenizer_dir}"],
                        world_size)


def save_checkpoints(rank: int, world_size: int, out_dir: str, tokenizer_dir: str, plan: dict) -> None:
    """Runs in each rank: for {layout: [variant, ...]}, a checkpoint under out_dir/layout/variant
    (one spawn for every layout: only megatron's model-parallel groups are rebuilt between them)."""
    for layout, variants in plan.items():
        for variant in variants:
            cfg = variant_config(variant, layout, tokenizer_dir, world_size)
            initialize(cfg.parallel, seed=SEED)
            chunks = build_model(cfg)
            layout_independent_weights(chunks, SEED)
            save_model_weights(chunks, cfg, Path(out_dir) / layout / variant)
        parallel_state.destroy_model_parallel()
    shutdown()

def reference_model(cfg) -> CausalLM:
    """The single-process model holding the same tensors as any checkpoint saved above with `cfg`."""
    model = build_single_process_model(single_process_config(cfg))
    layout_independent_weights([model], SEED)
    return CausalLM(model, cfg)


def save_in_process(cfg, directory: Path) -> CausalLM:
    """A single-process checkpoint written by this (test) process; returns the model it holds."""
    reference = reference_model(cfg)
    save_model_weights([reference.gpt], cfg, directory)
    return reference
