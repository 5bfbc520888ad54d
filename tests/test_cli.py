"""The command line's own surface: `megadiff --version` is the installed package's version."""
from __future__ import annotations

import errno
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

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


def test_overrides_may_follow_a_list_of_numbers(capsys):
    """`needles --lengths 64 128 data.prefix=X`: the list took the override in and was refused as an invalid int;
    it ends the list, and a list it leaves empty, a word that is neither, or a command without overrides are
    still refused."""
    from megadiff.cli import parse_arguments

    args = parse_arguments(["needles", "--load", "run", "data.split=1,0,0", "--lengths", "64", "128", "data.prefix=x",
                            "--depths", "0.5", "train.seed=3", "--trials", "2"])
    assert (args.lengths, args.depths, args.trials) == ([64, 128], [0.5], 2)
    assert args.overrides == ["data.split=1,0,0", "data.prefix=x", "train.seed=3"]
    for argv, said in ((["needles", "--load", "run", "--lengths", "data.prefix=x"],
                        "argument --lengths: expected at least one number before data.prefix=x"),
                       (["needles", "--load", "run", "--lengths", "64", "sixty"],
                        "argument --lengths: invalid int value: 'sixty'"),
                       (["icl", "--load", "run", "--dataset", "d", "--shots", "1", "a=b"],
                        "unrecognized arguments: a=b")):
        with pytest.raises(SystemExit) as exit_info:
            parse_arguments(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err, argv


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


def test_a_cache_directory_a_variable_names_is_said_to_come_from_it(monkeypatch, capsys, tmp_path):
    """torch's compile cache (or Triton's, transformers') under a path that is no directory: the variable is named."""
    from megadiff import cli

    in_the_way = tmp_path / "a-file"
    in_the_way.touch()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", f"{in_the_way}/inductor/")
    monkeypatch.setattr(cli, "_target", lambda path: lambda *args, **kwargs: os.makedirs(in_the_way / "inductor"))
    assert main(["params", "c.yaml"]) == 3
    assert capsys.readouterr().err == (f"megadiff params: Not a directory: {in_the_way / 'inductor'} (from "
                                       "$TORCHINDUCTOR_CACHE_DIR: point it at a directory you can write)\n")


def test_a_path_under_tmpdir_is_the_user_s_own(monkeypatch, capsys, tmp_path):
    """TMPDIR=/tmp holds the user's own outputs too: a refusal there is not the variable's."""
    from megadiff import cli

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cli, "_target", lambda path: lambda *args, **kwargs: os.makedirs(tmp_path / "a" / "b"))
    (tmp_path / "a").touch()
    assert main(["params", "c.yaml"]) == 3
    assert capsys.readouterr().err == f"megadiff params: Not a directory: {tmp_path / 'a' / 'b'}\n"


def test_a_broken_pipe_with_no_standard_output_file_is_not_taken_for_a_reader_gone(monkeypatch):
    """In-process callers (a notebook, pytest's capture): the pipe error is the command's own, raised."""
    import io

    from megadiff import cli

    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli._stdout_reader_gone() is False


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


def _megadiff(*args: str, **options) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megadiff", *args], stderr=subprocess.PIPE, **options)


def test_a_locale_of_another_encoding_runs_in_utf8_mode(tmp_path):
    """Under LC_ALL=C with PYTHONUTF8=0 every command ended in torch's import (its templates are UTF-8), and a
    path or prompt past ASCII in a traceback of megadiff's own."""
    config = tmp_path / "ünïcödé" / "diff-tiny.yaml"
    config.parent.mkdir()
    config.write_bytes(DEMO_CONFIG.read_bytes())
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    proc = _megadiff("params", str(config), f"output_dir={tmp_path / 'rün'}", stdout=subprocess.PIPE, env=env)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    assert out.decode("utf-8").startswith(f"{config}: variant diff")


def test_the_tools_scripts_run_in_utf8_mode_too(tmp_path):
    """tools/preprocess_data.py passes its arguments to the CLI: it ran in the locale's encoding."""
    missing = tmp_path / "ünïcödé" / "absent.yaml"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0"}
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "tools" / "preprocess_data.py"),
                           str(missing)], capture_output=True, env=env, timeout=300)
    assert proc.returncode == 2 and f"config file not found: {missing}" in proc.stderr.decode("utf-8"), proc.stderr


def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path):
    """`megadiff generate ... | head`: the exit code SIGPIPE gives, not a traceback (one per rank under torchrun)."""
    proc = _megadiff("params", str(DEMO_CONFIG), stdout=subprocess.PIPE)
    proc.stdout.close()  # before it prints its first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err, err[-3000:]


def test_a_console_whose_reader_went_away_goes_on_without_printing(capsys):
    """A training run piped into `head` went on to its end (rich's console exited with 1, unsaved, silent)."""
    from megadiff.console import plain_console

    read_end, write_end = os.pipe()
    os.close(read_end)
    with os.fdopen(write_end, "w") as pipe:
        console = plain_console(file=pipe)
        for line in range(3):
            console.print(f"iteration {line}" + " " * 70_000)  # more than a pipe's buffer: written, not held
    assert capsys.readouterr().err == "megadiff: its output's reader went away: going on without printing\n"
