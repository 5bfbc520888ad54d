"""Config files and overrides read alike: YAML 1.2 floats, duplicate keys, malformed overrides and files,
and relative paths from the file that sets them."""
from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

from megadiff.adapt.settings import load_finetune_config
from megadiff.config import ConfigError, build_config, dump_config, load_config
from megadiff.config.loader import load_yaml_tree, read_saved_config

BLEND = "[3e-1, /data/a, 7e-1, /data/b]"


def test_scientific_notation_in_a_file_is_a_float_as_in_an_override(tmp_path):
    (tmp_path / "run.yaml").write_text(f"data:\n  blend: {BLEND}\ntrain:\n  lr: 1e-4\n  min_lr: .5e-5\n"
                                       "logging:\n  wandb_run_name: '1e3'\n")
    from_file = load_config(tmp_path / "run.yaml")
    assert from_file.data.blend == [0.3, "/data/a", 0.7, "/data/b"]
    assert from_file == load_config(None, [f"data.blend={BLEND}", "train.lr=1e-4", "train.min_lr=.5e-5",
                                           "logging.wandb_run_name='1e3'"])
    dump_config(from_file, tmp_path / "saved.yaml")  # a string that reads as a float is written quoted
    assert load_config(tmp_path / "saved.yaml") == from_file


@pytest.mark.parametrize("text,line,key", [
    ("train:\n  lr: 0.1\nlogging:\n  log_interval: 5\ntrain:\n  iters: 10\n", 5, "'train'"),
    ("train:\n  lr: 0.1\n  lr: 0.2\n", 3, "'lr'"),
])
def test_a_key_given_twice_is_refused_naming_file_key_and_line(tmp_path, text, line, key):
    (tmp_path / "dup.yaml").write_text(text)
    with pytest.raises(ConfigError, match=rf"dup.yaml, line {line}: key {key} is given twice"):
        load_config(tmp_path / "dup.yaml")


def test_a_merge_key_is_no_duplicate_but_a_key_repeated_beside_it_is(tmp_path):
    (tmp_path / "merge.yaml").write_text("x: &d {lr: 0.1, iters: 5}\ntrain:\n  <<: *d\n  lr: 0.2\n")
    assert load_yaml_tree(tmp_path / "merge.yaml")["train"] == {"lr": 0.2, "iters": 5}
    (tmp_path / "merge.yaml").write_text("x: &d {lr: 0.1}\ntrain:\n  <<: *d\n  iters: 5\n  iters: 6\n")
    with pytest.raises(ConfigError, match="line 5: key 'iters' is given twice"):
        load_yaml_tree(tmp_path / "merge.yaml")


@pytest.mark.parametrize("key", ["k", "lr"])  # PyYAML 6.0.4 told an interned one-letter key from others
def test_a_nested_merge_of_an_anchor_holding_a_merge_is_no_duplicate(tmp_path, key):
    """PyYAML merges an anchored mapping in place: the check reads the mappings as written, and a mapping
    merging *b gets b's values, its own key over the one b merged (YAML's merge rule)."""
    (tmp_path / "merge.yaml").write_text(f"a: &a {{{key}: 1}}\nx:\n  y:\n    b: &b\n      <<: *a\n      {key}: 2\n"
                                         "c:\n  <<: *b\n")
    assert load_yaml_tree(tmp_path / "merge.yaml") == {"a": {key: 1}, "x": {"y": {"b": {key: 2}}}, "c": {key: 2}}


@pytest.mark.parametrize("key", ["k", "lr"])
def test_of_a_list_of_merged_mappings_the_earlier_one_wins(tmp_path, key):
    """YAML's merge rule, which PyYAML 6.0.0-6.0.3 kept and 6.0.4 reverses for all but one-letter keys."""
    (tmp_path / "merge.yaml").write_text(f"a: &a {{{key}: 1, x: 3}}\nb: &b {{{key}: 2, y: 4}}\nc:\n  <<: [*a, *b]\n"
                                         f"d:\n  <<: [*b, *a]\n  y: 5\n")
    tree = load_yaml_tree(tmp_path / "merge.yaml")
    assert tree["c"] == {key: 1, "x": 3, "y": 4} and tree["d"] == {key: 2, "x": 3, "y": 5}
    (tmp_path / "merge.yaml").write_text("c:\n  <<: [3]\n")
    with pytest.raises(ConfigError, match="merge.yaml, line 2: expected a mapping or list of mappings for merging"):
        load_yaml_tree(tmp_path / "merge.yaml")


def test_a_mapping_merging_itself_is_its_own_keys(tmp_path):
    """PyYAML drops the `<<` before following it; following it first recursed for ever."""
    (tmp_path / "merge.yaml").write_text("model: &m {num_layers: 2, <<: *m}\nx: &x {a: {<<: *x, b: 1}}\n")
    tree = load_yaml_tree(tmp_path / "merge.yaml")
    assert tree["model"] == {"num_layers": 2}
    assert tree["x"]["a"]["b"] == 1 and tree["x"]["a"]["a"] is tree["x"]["a"]  # an ancestor: a cycle, as PyYAML's


def test_a_config_saved_before_yaml_12_numbers_loads_as_it_was_written(tmp_path):
    """config.yaml files megadiff wrote for YAML 1.1 readers hold strings like 3e-4 unquoted (a run
    name of a learning-rate sweep): they still load, as strings; and what it writes now loads back alike."""
    cfg = build_config({}, ["logging.wandb_run_name='3e-4'", "output_dir='1e-3'"])
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))  # as megadiff wrote them
    assert "wandb_run_name: 3e-4\n" in saved.read_text()
    assert build_config(read_saved_config(saved)) == cfg
    dump_config(cfg, saved)
    assert build_config(read_saved_config(saved)) == cfg


def test_a_directory_given_for_a_config_file_is_said_to_be_one(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path} is a directory: give a config file"):
        load_config(str(tmp_path))


@pytest.mark.parametrize("text", ["", "# megadiff: a resolved config (read with YAML 1.2 numbers)\n", "train:\n  iters: 4\n"],
                         ids=["empty", "the header alone", "no model"])
def test_a_saved_config_without_its_model_is_refused_not_read_as_defaults(tmp_path, text):
    """Emptied or cut short: read as the schema's defaults, a checkpoint was said to be of another model (64 wide,
    not its 128) and a run to have stopped at 4 of the default 100 iterations."""
    (tmp_path / "config.yaml").write_text(text)
    with pytest.raises(ConfigError, match=f"{tmp_path / 'config.yaml'}: no model section: not a config megadiff wrote "
                                          "whole"):
        read_saved_config(tmp_path / "config.yaml")


@pytest.mark.parametrize("text,message", [
    ("output_dir: runs/${oc.env:USER\n", "output_dir: missing BRACE_CLOSE"),
    ("data:\n  sources: !!set {a, b}\n", "data.sources: Value 'set' is not a supported primitive type"),
    ("train:\n  ~: 1\n", "train: Incompatible key type 'NoneType'"),
    ("base: 5\n", "base must name a config file, got 5"),
    ("- model\n- train\n", "bad.yaml: the top level must be a mapping"),
    ("base: base.yaml\nmodel: [1, 2]\n", "bad.yaml: Cannot merge "),  # OmegaConf 2.3 and 2.4 go on differently
])
def test_a_file_omegaconf_cannot_hold_is_a_config_error(tmp_path, text, message):
    (tmp_path / "base.yaml").write_text("model:\n  hidden_size: 128\n")
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(tmp_path / "bad.yaml")


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    (tmp_path / "latin1.yaml").write_bytes("output_dir: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="latin1.yaml: not UTF-8 text"):
        load_config(tmp_path / "latin1.yaml")


@pytest.mark.parametrize("override,message", [
    ("output_dir=/a/run #2", r"override 'output_dir=/a/run #2': ' #' starts a YAML comment, which would drop '#2'"),
    ("data.blend=[0.5,a", r"override 'data.blend=\[0.5,a': (did not find )?expected ',' or '\]'"),  # C/Python parser
    ("data.blend=[0.5, a] #b", r"would drop '#b'"),
    ("train=lr: 0.1 #fast", r"would drop '#fast'"),  # a block mapping: its value ends before a BlockEnd
    ("output_dir=${nope}", r"output_dir: Interpolation key 'nope' not found"),
    ("output_dir=${oc.env:MEGADIFF_TEST_UNSET}", r"output_dir: .*MEGADIFF_TEST_UNSET"),
    ("=3", r"override '=3' must look like key.sub=value"),
    ("model..x=1", r"override 'model..x=1' must look like key.sub=value"),
    ("data.blend.1=c", r"override 'data.blend.1=c': a list's items are not set one by one; give the whole list "
                       r"\(data.blend=\[...\]\)"),
])
def test_bad_overrides_are_config_errors_naming_them(override, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, [override])


def test_a_quoted_value_keeps_its_hash():
    assert build_config({}, ["output_dir='/a/run #2'", "logging.wandb_run_name=a#b"]).output_dir == "/a/run #2"
    with pytest.raises(ConfigError, match="would drop"):
        build_config({}, ["logging.wandb_run_name=run #2"])


def test_bad_yaml_in_a_file_is_a_config_error_and_exit_code_2(tmp_path, capsys):
    from megadiff.cli import main

    (tmp_path / "bad.yaml").write_text("train:\n  lr: [1e-3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml, line 3: expected ',' or '\]'"):
        load_config(tmp_path / "bad.yaml")
    assert main(["params", str(tmp_path / "bad.yaml")]) == 2
    assert "megadiff: config error: " in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [("inf", ""), ("1e999", ""), ("10000.5", ": 10000.5 must be an integer")])
def test_a_rope_theta_megatron_cannot_take_is_a_config_error(value, message):
    with pytest.raises(ConfigError, match=f"model.rope_theta{message}"):
        build_config({}, [f"model.rope_theta={value}"])


def _adapt_workspace(root):
    """A shared adaptation config naming ../deepspeed/zero2.json beside it, a user's config inheriting
    it from elsewhere, and a decoy JSON where the user's own directory would lead."""
    (root / "shared/adapt").mkdir(parents=True)
    (root / "shared/deepspeed").mkdir()
    (root / "shared/deepspeed/zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    (root / "shared/adapt/dex.yaml").write_text("train:\n  iters: 2\ndeepspeed: ../deepspeed/zero2.json\n"
                                                "output_dir: out\n")
    (root / "deepspeed").mkdir()
    (root / "deepspeed/zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    (root / "user").mkdir()
    (root / "user/my.yaml").write_text(f"base: {root / 'shared/adapt/dex.yaml'}\n")
    (root / "model").mkdir()
    (root / "model/config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2,
                                                        "num_attention_heads": 2}))
    (root / "model/tokenizer.json").write_text("{}")
    save_file({"model.embed_tokens.weight": torch.zeros(1)}, str(root / "model/model.safetensors"))  # read: its header
    (root / "d.jsonl").write_text('{"text": "a"}\n')
    (root / "elsewhere/deeper").mkdir(parents=True)


def test_a_relative_deepspeed_path_is_read_from_the_file_that_sets_it(tmp_path, monkeypatch):
    _adapt_workspace(tmp_path)
    monkeypatch.chdir(tmp_path / "elsewhere/deeper")
    cfg = load_finetune_config(tmp_path / "user/my.yaml", [f"model.path={tmp_path / 'model'}",
                                                           f"data.files=[{tmp_path / 'd.jsonl'}]"])
    assert cfg.deepspeed == str(tmp_path / "shared/deepspeed/zero2.json")


def test_a_relative_chat_template_is_read_from_the_file_that_sets_it(tmp_path, monkeypatch):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft/turns.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    (tmp_path / "sft/base.yaml").write_text("data:\n  messages_key: messages\n  chat_template: turns.jinja\n")
    (tmp_path / "run.yaml").write_text("base: sft/base.yaml\n")
    monkeypatch.chdir(tmp_path / "sft")  # the working directory still comes first, as before
    assert load_config(tmp_path / "run.yaml").data.chat_template.startswith("{% for m")
    monkeypatch.chdir(tmp_path)
    assert load_config(tmp_path / "run.yaml").data.chat_template.startswith("{% for m")


def test_a_checkpoints_config_is_read_against_the_schema_not_the_checks_of_a_run(tmp_path):
    """A checkpoint trained with TransformerEngine, read where it is not installed, or saved before a check
    that now refuses its schedule: its resume, conversion and evaluation read it as it ran."""
    from megadiff.checkpoint.format import CONFIG_FILE, checkpoint_config

    tree = {"model": {"transformer_impl": "te"}, "train": {"iters": 200, "lr_warmup_iters": 100,
                                                            "lr_decay_iters": 100}}
    (tmp_path / CONFIG_FILE).write_text(yaml.safe_dump(tree))
    saved = checkpoint_config(tmp_path)
    assert (saved.model.transformer_impl, saved.train.lr_decay_iters) == ("te", 100)
    with pytest.raises(ConfigError, match="model.transformer_impl: 'te' needs TransformerEngine"):
        build_config(tree)  # a run asking for them is refused
    with pytest.raises(ConfigError, match="train.lr_decay_iters: 100 ends the decay before"):
        build_config({"train": tree["train"]})


def test_a_saved_configs_interpolation_is_read_as_written_not_with_the_readers_environment(tmp_path, monkeypatch):
    """A checkpoint's config.yaml (one downloaded) naming ${oc.env:...}: read again, it took the reader's secret
    into the config, and from there into what the reader wrote (an export's sidecar, uploaded with it)."""
    from megadiff.config.loader import saved_config

    data = build_config({}).model_dump(mode="json")
    data["logging"]["wandb_run_name"] = "${oc.env:MEGADIFF_TEST_SECRET}"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.setenv("MEGADIFF_TEST_SECRET", "the reader's token")
    loaded = saved_config(read_saved_config(tmp_path / "config.yaml"))
    assert loaded.logging.wandb_run_name == "${oc.env:MEGADIFF_TEST_SECRET}"
    dump_config(loaded, tmp_path / "written.yaml")
    assert "the reader's token" not in (tmp_path / "written.yaml").read_text()


ESCAPED_INTERPOLATIONS = pytest.mark.parametrize(
    "written, value", [(r"run-\${x}", "run-${x}"), (r"\\\${x}", "\\" + "${x}")],
    ids=["escaped interpolation", "backslash before it"])


@ESCAPED_INTERPOLATIONS
def test_a_run_config_with_an_escaped_interpolation_reads_back_as_saved(tmp_path, written, value):
    """Its saved config holds the literal `${x}`: reading it back (resume, convert, evaluate) resolved it again."""
    from megadiff.config.loader import saved_config

    cfg = build_config({"logging": {"wandb_run_name": written}})
    assert cfg.logging.wandb_run_name == value
    dump_config(cfg, tmp_path / "config.yaml")
    assert saved_config(read_saved_config(tmp_path / "config.yaml")) == cfg


@ESCAPED_INTERPOLATIONS
def test_a_run_config_with_an_escaped_interpolation_runs_again_from_its_saved_config(tmp_path, written, value):
    """`megadiff pretrain RUN/config.yaml` (and adapt's) reads the saved config as a config file: its literal `${x}`
    was resolved again, failing (no setting x) or reading another setting's value."""
    cfg = build_config({"output_dir": str(tmp_path / written), "logging": {"wandb_run_name": written}})
    assert cfg.logging.wandb_run_name == value
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    assert load_config(tmp_path / "config.yaml", ["train.iters=7"]) == cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"iters": 7})})


@pytest.mark.parametrize("setting, written, value", [
    ("train.seed", "010", 10), ("data.split", "0755", "0755"), ("data.tokenizer", "no", "no"),
    ("logging.wandb_run_name", "off", "off"), ("logging.wandb_project", "1:30", "1:30"),
    ("logging.wandb_run_name", "0o17", "0o17"), ("logging.tensorboard", "off", False)])
def test_yaml_11_octals_base_60_numbers_and_yes_no_read_as_written(tmp_path, setting, written, value):
    """YAML 1.1 (PyYAML's, OmegaConf's) read 010 as 8, 1:30 as 90 and no/off as false: a seed changed silently, a
    tokenizer or run name `no` was refused as not a string. Files and overrides read them as YAML 1.2 does, and a
    saved config quotes them for YAML 1.1 readers too."""
    section, key = setting.split(".")
    (tmp_path / "run.yaml").write_text(f"{section}:\n  {key}: {written}\n")
    from_file = load_config(tmp_path / "run.yaml")
    assert getattr(getattr(from_file, section), key) == value
    assert load_config(None, [f"{setting}={written}"]) == from_file
    dump_config(from_file, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == from_file
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())[section][key] == value


@pytest.mark.parametrize("written", ["1:30", "0o17"])
def test_a_count_written_in_base_60_or_as_0o_is_refused_naming_its_key(tmp_path, written):
    (tmp_path / "run.yaml").write_text(f"train:\n  iters: {written}\n")
    for read in (lambda: load_config(tmp_path / "run.yaml"), lambda: load_config(None, [f"train.iters={written}"])):
        with pytest.raises(ConfigError, match="train.iters: Input should be a valid integer"):
            read()
