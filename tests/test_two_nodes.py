"""Runs across two "nodes" on this machine (tests/distributed.py's `nodes`): each node's ranks have a TMPDIR, HOME
and XDG_CACHE_HOME of their own, as node-local disks, and the local ranks torchrun --nnodes 2 gives them, while
the output and data directories are shared. What one node writes and another reads must be on the shared ones,
and named alike on every node."""
from __future__ import annotations

import shutil

from megadiff.config import load_config
from megadiff.data.prepare import prepare
from tests.pretrain_runs import DEMO_CONFIG, losses, run_pretrain_in_ranks, tiny_overrides


def test_a_tokenizer_copied_onto_each_node_at_a_path_of_its_own_trains_as_one_path(tmp_path, small_tokenizer_dir):
    """data.tokenizer may be a node-local copy (its contents are compared, not its path): named by its path in
    megatron's index cache, the second node's ranks looked for index files rank 0 never built."""
    prefix = tmp_path / "prepared" / "kjv"
    prepare(load_config(str(DEMO_CONFIG), tiny_overrides(small_tokenizer_dir, tmp_path / "corpus")
                        + [f"data.prefix={prefix}"]).data)
    nodes = tmp_path / "nodes"
    for node in ("node0", "node1"):  # where node_environment puts each node's HOME
        shutil.copytree(small_tokenizer_dir, nodes / node / "home" / "tokenizer")

    def run(name: str, tokenizer: str, **options) -> list[float]:
        overrides = [*tiny_overrides(small_tokenizer_dir, tmp_path / name / "cache"), f"data.tokenizer={tokenizer}",
                     "data.bundled_corpus=null", f"data.prefix={prefix}", "train.iters=3",
                     f"output_dir={tmp_path / name / 'run'}"]
        run_pretrain_in_ranks(2, overrides, **options)
        return losses(tmp_path / name / "run")

    one_path = run("one-path", str(small_tokenizer_dir))
    assert len(one_path) == 3
    assert run("node-local", "~/tokenizer", nodes=nodes) == one_path
