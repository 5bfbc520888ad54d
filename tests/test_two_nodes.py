"""Runs across two "nodes" on this machine (tests/distributed.py's `nodes`): each node's ranks have a TMPDIR, HOME
and XDG_CACHE_HOME of their own, as node-local disks, and the local ranks torchrun --nnodes 2 gives them, while
the output and data directories are shared. What one node writes and another reads must be on the shared ones,
and named alike on every node."""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from megadiff.config import load_config
from megadiff.data.prepare import prepare
from tests.distributed import megadiff_main, run_reporting_ranks
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


NEW_DATA_LAG_SECONDS = 2.0  # how late a node's filesystem shows the prepared data another node just wrote


def _pretrain_on_nodes_seeing_new_data_late(argv: list[str]) -> int:
    """`megadiff ARGV` where every rank but rank 0 runs on a node whose shared filesystem (NFS's attribute caches)
    shows a .bin or .idx another node wrote in the last NEW_DATA_LAG_SECONDS as not there yet."""
    if os.environ["RANK"] != "0":
        for name in ("exists", "is_file"):
            seen = getattr(Path, name)
            setattr(Path, name, lambda path, seen=seen: seen(path) and not (
                path.suffix in (".bin", ".idx") and time.time() - os.stat(path).st_mtime < NEW_DATA_LAG_SECONDS))
    return megadiff_main(argv)


def test_new_data_seen_late(tmp_path, small_tokenizer_dir):
    """Rank 0 prepares the bundled corpus on a first run while the others wait; a node that saw its files a moment
    late refused the run: "not found; prepare the data first". (A short name: a long TMPDIR of the test's nodes is
    too long for the socket of the checkpoint writers' manager process, AF_UNIX paths being 107 bytes at most.)"""
    root = tmp_path / "late"
    overrides = [*tiny_overrides(small_tokenizer_dir, root / "cache"), "train.iters=1", f"output_dir={root / 'run'}"]
    run_reporting_ranks(2, _pretrain_on_nodes_seeing_new_data_late, ["pretrain", str(DEMO_CONFIG), *overrides],
                        nodes=tmp_path / "nodes")
    assert len(losses(root / "run")) == 1
