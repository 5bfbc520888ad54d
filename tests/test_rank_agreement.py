"""Ranks started differently are refused on every rank: an output_dir that is not rank 0's directory on some
node (its checkpoints would lack that node's shards), or another config or starting checkpoint."""
from __future__ import annotations

import os
import socket
from pathlib import Path

from tests.distributed import megadiff_main, run_ranks, run_reporting_ranks
from tests.pretrain_runs import DEMO_CONFIG, tiny_overrides


def agree_on(rank: int, world_size: int, directories: list[str], facts: list[dict], report: str,
             stale_on_rank: int | None = None) -> None:
    import errno
    import pathlib

    import torch.distributed as dist

    from megadiff.rank_agreement import check_ranks_agree

    if rank == stale_on_rank:  # what a dead NFS mount answers: Path.exists() raises it, where ENOENT is False
        def stale(path):
            raise OSError(errno.ESTALE, "Stale file handle", str(path))
        pathlib.Path.exists = stale
    dist.init_process_group("gloo")
    try:
        check_ranks_agree({"output_dir": directories[rank]} if directories[rank] else {}, facts[rank])
        outcome = "agreed"
    except Exception as err:  # noqa: BLE001 -- what each rank raised, for the test to compare
        outcome = f"{type(err).__name__}: {err}"
    Path(report, f"rank{rank}").write_text(outcome)
    dist.destroy_process_group()


def outcomes(tmp_path: Path, directories: list[Path | None], facts: list[dict], stale_on_rank: int | None = None
             ) -> list[str]:
    """None for directories: no shared directory to check (pre-training's second check, of its start)."""
    run_ranks(2, agree_on, [str(d) if d else "" for d in directories], facts, str(tmp_path), stale_on_rank,
              timeout=120)
    return [(tmp_path / f"rank{rank}").read_text() for rank in range(2)]


def test_ranks_started_alike_agree_and_leave_no_probe(tmp_path):
    shared = tmp_path / "run"
    facts = {"config": {"train": {"lr": 3e-4}}, "starting checkpoint": None}
    assert outcomes(tmp_path, [shared, shared], [facts, facts]) == ["agreed", "agreed"]
    assert list(shared.iterdir()) == []  # rank 0 made the directory; its probe is gone


def test_a_node_with_another_output_directory_is_refused_on_every_rank(tmp_path):
    """A node-local path (or a failed mount) in place of the shared directory: that rank's checkpoint
    shards went elsewhere, and every committed checkpoint lacked them."""
    facts = {"config": {}}
    first, second = outcomes(tmp_path, [tmp_path / "shared", tmp_path / "node1-local"], [facts, facts])
    host = socket.gethostname()
    assert first == second == (f"ConfigError: output_dir: {tmp_path / 'shared'} is not the same directory on every "
                               f"node: rank 1 ({host}, at {tmp_path / 'node1-local'}) did not see the file rank 0 "
                               f"({host}) wrote there; every rank reads and writes it (checkpoint shards, dataset "
                               "indices): give every node the same shared directory")
    # a rank whose view of the directory raises (a stale handle) is refused the same way, saying so, rather than
    # leaving the others in the next collective until the timeout
    first, second = outcomes(tmp_path, [tmp_path / "shared"] * 2, [facts, facts], stale_on_rank=1)
    assert first == second
    assert f"rank 1 ({host}: [Errno 116] Stale file handle: '{tmp_path / 'shared'}/.rank0-probe-" in first


def test_another_config_or_starting_checkpoint_on_one_rank_is_refused_naming_it(tmp_path):
    shared = tmp_path / "run"
    facts = [{"config": {"train": {"lr": 3e-4, "iters": 10}}, "starting checkpoint": "run/iter_0000006"},
             {"config": {"train": {"lr": 5e-2, "iters": 10}}, "starting checkpoint": "run/iter_0000004"}]
    first, second = outcomes(tmp_path, [shared, shared], facts)
    assert first == second
    host = socket.gethostname()
    assert first == ("ConfigError: the ranks were started differently (a config file or data that differs between "
                     f"nodes?): config.train.lr: rank 0 ({host}) has 0.0003, rank 1 ({host}) has 0.05; starting "
                     f"checkpoint: rank 0 ({host}) has 'run/iter_0000006', rank 1 ({host}) has 'run/iter_0000004'")
    # the facts alone, with no directory to probe
    assert outcomes(tmp_path, [None, None], facts) == [first, first]
    assert outcomes(tmp_path, [None, None], facts[:1] * 2) == ["agreed", "agreed"]


def test_an_output_directory_rank_0_cannot_write_is_refused_on_every_rank(tmp_path):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    first, second = outcomes(tmp_path, [in_the_way / "run"] * 2, [{}, {}])
    assert first.startswith(("FileExistsError", "NotADirectoryError"))
    assert second == f"MegadiffError: rank 0 failed: {first}"


def megadiff_on_rank(argv: list[str], per_rank: dict[int, list[str]]) -> int:
    """`megadiff ARGV`, with this rank's own extra overrides (as a node with its own copy of a config would)."""
    return megadiff_main([*argv, *per_rank.get(int(os.environ["RANK"]), [])])


def test_pretraining_ranks_started_differently_are_refused_before_any_data_or_model(small_tokenizer_dir, tmp_path):
    """Another lr on one rank trained its data-parallel replica apart without a word (rank 0's saved), another
    layout hung; a node-local output_dir committed checkpoints without that node's shards."""
    argv = ["pretrain", str(DEMO_CONFIG), *tiny_overrides(small_tokenizer_dir, tmp_path / "cache"),
            f"output_dir={tmp_path / 'run'}", "train.iters=2"]
    lr = run_reporting_ranks(2, megadiff_on_rank, argv, {1: ["train.lr=0.05"]}, expect=2)
    host = socket.gethostname()
    assert lr.stderr.count(f"config.train.lr: rank 0 ({host}) has 0.005, rank 1 ({host}) has 0.05") == 2
    # checked before the model-parallel groups form, where another layout waited for the timeout
    layout = run_reporting_ranks(2, megadiff_on_rank, argv, {1: ["parallel.tensor=2"]}, expect=2)
    assert layout.stderr.count(f"config.parallel.tensor: rank 0 ({host}) has 1, rank 1 ({host}) has 2") == 2
    local = run_reporting_ranks(2, megadiff_on_rank, argv, {1: [f"output_dir={tmp_path / 'node1'}"]}, expect=2)
    assert local.stderr.count(f"output_dir: {tmp_path / 'run'} is not the same directory on every node: rank 1") == 2
    assert not (tmp_path / "cache" / "indices").exists()  # refused before the data


def test_a_probe_a_shared_filesystem_shows_late_is_waited_for(tmp_path, monkeypatch):
    """NFS attribute caches may show rank 0's new file a moment late: not seen at first is not yet refused."""
    from megadiff import rank_agreement

    looks = []
    monkeypatch.setattr(Path, "exists", lambda path: looks.append(path) or len(looks) > 1)
    assert rank_agreement._view(tmp_path, "probe") == (str(tmp_path), True, None) and len(looks) == 2


def test_probes_written_before_a_directory_that_fails_are_removed(tmp_path):
    import pytest

    from megadiff import rank_agreement

    (tmp_path / "a-file").write_text("")
    with pytest.raises(OSError):
        rank_agreement._write_probes([tmp_path / "run", tmp_path / "a-file" / "data"])
    assert list((tmp_path / "run").iterdir()) == []


def test_many_differing_ranks_are_named_three_and_counted():
    import pytest

    from megadiff.config import ConfigError
    from megadiff.rank_agreement import _differences, _refuse_unshared

    views = [("h0", "/shared", True, None)] + [(f"h{rank}", f"/local{rank}", False, None) for rank in range(1, 6)]
    with pytest.raises(ConfigError, match=r"rank 1 \(h1, at /local1\), 2 \(h2, at /local2\), 3 \(h3, at /local3\) "
                                          r"and 2 more did not see"):
        _refuse_unshared("output_dir", views)
    lines = _differences([("h0", {"lr": 1})] + [(f"h{rank}", {"lr": 2}) for rank in range(1, 6)])
    assert lines == ["lr: rank 0 (h0) has 1, rank 1 (h1) has 2, rank 2 (h2) has 2, rank 3 (h3) has 2 "
                     "(and 2 more ranks)"]


def test_exactly_three_blind_ranks_are_named_with_no_count_of_more():
    """The "and N more" tail only where ranks were left out of the message: never "and 0 more"."""
    import pytest

    from megadiff.config import ConfigError
    from megadiff.rank_agreement import _refuse_unshared

    views = [("h0", "/shared", True, None)] + [(f"h{rank}", "/shared", False, None) for rank in range(1, 4)]
    with pytest.raises(ConfigError, match=r"rank 1 \(h1\), 2 \(h2\), 3 \(h3\) did not see") as refused:
        _refuse_unshared("output_dir", views)
    assert "more" not in str(refused.value)


def test_a_config_is_compared_without_its_node_local_keys_and_left_unchanged():
    """Keys naming a node's own copy of an input (dotted, in sections) differ between nodes by design: comparing
    them would refuse ranks started alike. The config itself must keep them."""
    from megadiff.rank_agreement import comparable

    settings = {"data": {"tokenizer": "/node1/tok", "seq_length": 64}, "cache": "/local", "train": {"lr": 1e-3}}
    assert comparable(settings, ("data.tokenizer", "cache", "train.absent")) == {
        "data": {"seq_length": 64}, "train": {"lr": 1e-3}}
    assert settings["data"]["tokenizer"] == "/node1/tok" and settings["cache"] == "/local"
