"""The command line's own surface: `megadiff --version` is the installed package's version."""
from __future__ import annotations

import errno
import os
from importlib.metadata import version

import pytest

from megadiff.cli import main
from tests.pretrain_runs import DEMO_CONFIG


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"megadiff {version('megadiff')}"


def test_overrides_may_follow_a_commands_options(capsys):
    """`params CONFIG --world-size 64 parallel.tensor=2`: argparse alone refused the override after the
    option; an unknown option is still refused."""
    from megadiff.cli import parse_arguments

    args = parse_arguments(["params", "cfg.yaml", "a.b=1", "--world-size", "64", "parallel.tensor=2", "--fit", "80",
                            "train.seed=3"])
    assert (args.config, args.world_size, args.fit) == ("cfg.yaml", 64, 80)
    assert args.overrides == ["a.b=1", "parallel.tensor=2", "train.seed=3"]
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["params", "cfg.yaml", "--wrld-size", "64", "parallel.tensor=2"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --wrld-size 64" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_arguments(["convert", "to-hf", "--load", "run", "--save", "hf", "stray"])  # no overrides there


@pytest.mark.parametrize("given, said", [("0", "0 is not >= 1"), ("-8", "-8 is not >= 1"),
                                         ("x", "'x' is not a whole number")])
def test_a_world_size_is_a_positive_number(capsys, given, said):
    """0 divided by zero in the batch checks; -8 was reported as profile ranks outside the run."""
    from megadiff.cli import parse_arguments

    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["params", "cfg.yaml", "--world-size", given])
    assert exit_info.value.code == 2 and f"argument --world-size: {said}" in capsys.readouterr().err


@pytest.mark.parametrize("given", ["inf", "nan", "0", "-5"])
def test_fit_is_a_gpus_memory(capsys, given):
    """inf and nan stopped `params` with a traceback; 0 and -5 listed no layout, advising more GPUs."""
    from megadiff.cli import parse_arguments

    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["params", "cfg.yaml", "--fit", given])
    assert exit_info.value.code == 2
    assert f"argument --fit: {given} is not a GPU's memory in GiB (a number > 0)" in capsys.readouterr().err


@pytest.mark.parametrize("options, said", [
    (["--limit", "0"], "argument --limit: 0 is not a number of documents, or a fraction of them (a number > 0)"),
    (["--limit", "-1"], "argument --limit: -1 is not a number of documents"),
    (["--num-fewshot", "-1"], "argument --num-fewshot: -1 is not >= 0"),
])
def test_lm_eval_counts_are_refused_as_the_command_is_read(capsys, options, said):
    """--limit 0 or -1 ended in lm_eval's traceback after the model loaded; --num-fewshot -1 ran as 0 shots."""
    from megadiff.cli import parse_arguments

    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(["lm-eval", "--load", "run", "--tasks", "arc_easy", *options])
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.parametrize("command", [["lm-eval", "--load", "run", "--tasks", "arc_easy"],
                                     ["icl", "--load", "run", "--dataset", "data"], ["evaluate", "--load", "run"],
                                     ["generate", "--load", "run", "--prompts", "p.jsonl"]])
def test_an_output_that_is_a_directory_is_refused_as_the_command_is_read(capsys, tmp_path, command):
    """Found only when the finished results were written: lost, after minutes of evaluation."""
    from megadiff.cli import parse_arguments

    with pytest.raises(SystemExit) as exit_info:
        parse_arguments([*command, "--output", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"argument --output: {tmp_path} is a directory; give the file to write" in capsys.readouterr().err


@pytest.mark.parametrize("argv, target, call", [
    (["prepare-data", "c.yaml", "a=1", "--part", "0/2"], "megadiff.data.prepare:prepare_from_config",
     (("c.yaml", ["a=1"]), {"part": "0/2"})),
    (["pretrain", "c.yaml"], "megadiff.training.pretrain:pretrain_from_config", (("c.yaml", []), {})),
    (["convert", "to-hf", "--load", "r", "--save", "h", "--remote-code"], "megadiff.convert.to_hf:convert_to_hf",
     (("r", "h"), {"dtype": None, "check": True, "remote_code": True})),
    (["convert", "from-hf", "--load", "h", "--save", "c", "--dtype", "bf16", "--no-check"],
     "megadiff.convert.from_hf:convert_from_hf", (("h", "c"), {"dtype": "bf16", "check": False, "pad_vocab": None})),
    (["convert", "from-hf", "--load", "h", "--save", "c", "--pad-vocab", "128"],
     "megadiff.convert.from_hf:convert_from_hf", (("h", "c"), {"dtype": None, "check": True, "pad_vocab": 128})),
])
def test_each_command_calls_its_function_with_its_options(monkeypatch, argv, target, call):
    from megadiff import cli

    calls = []
    monkeypatch.setattr(cli, "_target", lambda path: lambda *args, **kwargs: calls.append((path, (args, kwargs))))
    args = cli.parse_arguments(argv)
    args.run(args)
    assert calls == [(target, call)]


@pytest.mark.parametrize("code, said", [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only")])
def test_a_storage_refusal_is_said_in_a_line(monkeypatch, capsys, code, said):
    """A full disk or read-only mount under prepare-data or to-hf: what the machine refused and where, not a
    traceback from inside the writer."""
    from megadiff import cli

    def refused(*args, **kwargs):
        raise OSError(code, os.strerror(code), "/data/prepared/corpus.bin")
    monkeypatch.setattr(cli, "_target", lambda path: refused)
    assert main(["prepare-data", "c.yaml"]) == 3
    assert capsys.readouterr().err == f"megadiff prepare-data: {os.strerror(code)}: /data/prepared/corpus.bin\n"
    assert said in os.strerror(code)


def test_a_full_disk_met_while_writing_is_said_without_a_file_name(monkeypatch, capsys):
    """A write() on a full disk raises an OSError that names no file (as writing to Linux's /dev/full does)."""
    from megadiff import cli

    def writes_to_a_full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cli, "_target", lambda path: writes_to_a_full_disk)
    assert main(["prepare-data", "c.yaml"]) == 3
    assert capsys.readouterr().err == "megadiff prepare-data: No space left on device (writing its output)\n"


def test_an_output_path_through_a_file_is_said_in_a_line(tmp_path, capsys):
    """data.prefix (as output_dir, --save, --output) under a path that is a file: the mkdir's refusal, not its
    traceback (a bad-input review found it in almost every command)."""
    (tmp_path / "afile").write_text("")
    for prefix, said in ((tmp_path / "afile" / "sub" / "x", "Not a directory"), (tmp_path / "afile" / "x", None)):
        assert main(["prepare-data", str(DEMO_CONFIG), f"data.prefix={prefix}"]) == 3
        err = capsys.readouterr().err
        assert err.startswith("megadiff prepare-data: ") and str(tmp_path / "afile") in err and err.count("\n") == 1
        assert said is None or said in err


def test_ctrl_c_is_said_in_a_line_with_the_shell_s_code(monkeypatch, capsys):
    from megadiff import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(cli, "_target", lambda path: interrupted)
    assert main(["convert", "to-hf", "--load", "run", "--save", "hf"]) == 130
    assert capsys.readouterr().err == "megadiff convert: interrupted\n"


def test_an_error_of_megadiff_itself_keeps_its_traceback(monkeypatch):
    from megadiff import cli

    def bug(*args, **kwargs):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "a file megadiff wrote itself")
    monkeypatch.setattr(cli, "_target", lambda path: bug)
    with pytest.raises(FileNotFoundError):
        main(["prepare-data", "c.yaml"])
