"""Runs across two "nodes" on this machine (tests/distributed.py's `nodes`): each node's ranks have a TMPDIR, HOME
and XDG_CACHE_HOME of their own, as node-local disks, and the local ranks torchrun --nnodes 2 gives them, while
the output and data directories are shared. What one node writes and another reads must be on the shared ones,
and named alike on every node."""
from __future__ import annotations

import shutil
from pathlib import Path

from megadiff.config import load_config
from megadiff.data.prepare import prepare
from tests.pretrain_runs import DEMO_CONFIG, losses, run_pretrain_in_ranks, tiny_overrides

NODE_LOCAL_TOKENIZER = "~/tokenizer"  # each node's copy, in its own HOME


def _tokenizer_on_each_node(nodes: Path, tokenizer: Path) -> None:
    for node in ("node0", "node1"):  # where node_environment puts each node's HOME
        shutil.copytree(tokenizer, nodes / node / "home" / "tokenizer")


def _losses(root: Path, tokenizer_dir: Path, tokenizer: str, data: list[str], nodes: Path | None = None) -> list[float]:
    """The loss curve of a 3-iteration run of 2 ranks (as two nodes where `nodes` is given) under `root`."""
    overrides = [*tiny_overrides(tokenizer_dir, root / "cache"), f"data.tokenizer={tokenizer}", *data,
                 "train.iters=3", f"output_dir={root / 'run'}"]
    run_pretrain_in_ranks(2, overrides, nodes=nodes)
    return losses(root / "run")


def test_a_tokenizer_copied_onto_each_node_at_a_path_of_its_own_trains_as_one_path(tmp_path, small_tokenizer_dir):
    """data.tokenizer may be a node-local copy (its contents are compared, not its path): named by its path in
    megatron's index cache, the second node's ranks looked for index files rank 0 never built."""
    prefix = tmp_path / "prepared" / "kjv"
    prepare(load_config(str(DEMO_CONFIG), tiny_overrides(small_tokenizer_dir, tmp_path / "corpus")
                        + [f"data.prefix={prefix}"]).data)
    _tokenizer_on_each_node(tmp_path / "nodes", small_tokenizer_dir)
    data = ["data.bundled_corpus=null", f"data.prefix={prefix}"]
    one_path = _losses(tmp_path / "one-path", small_tokenizer_dir, str(small_tokenizer_dir), data)
    assert len(one_path) == 3
    assert _losses(tmp_path / "node-local", small_tokenizer_dir, NODE_LOCAL_TOKENIZER, data,
                   nodes=tmp_path / "nodes") == one_path


def test_the_bundled_corpus_is_found_by_every_node_reading_its_own_tokenizer_copy(tmp_path, small_tokenizer_dir):
    """The bundled corpus is prepared by rank 0 under a prefix named after the tokenizer: named by its path, the
    second node looked for it under a prefix of its own copy's path ("not found; prepare the data first")."""
    _tokenizer_on_each_node(tmp_path / "nodes", small_tokenizer_dir)
    one_path = _losses(tmp_path / "one-path", small_tokenizer_dir, str(small_tokenizer_dir), [])
    assert len(one_path) == 3
    assert _losses(tmp_path / "node-local", small_tokenizer_dir, NODE_LOCAL_TOKENIZER, [],
                   nodes=tmp_path / "nodes") == one_path
