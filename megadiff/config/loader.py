"""YAML + `key.sub=value` overrides -> a validated `Config`.

A YAML file may name `base: other.yaml` (relative to itself) to inherit from. Files and overrides read scalars as
YAML 1.2 does (1e-4 is a float; 010, 1:30 and no are strings, which the schema reads per key), and a key given
twice in a mapping is an error.
A relative `deepspeed` or `data.chat_template` path is read from the working directory, else from the
directory of the file that sets it.
"""
from __future__ import annotations

import difflib
import glob
import json
import os
import re
from pathlib import Path
from typing import Iterable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from megadiff.config.schema import Config
from megadiff.config.validate import ConfigError, validate_config
from megadiff.errors import first_line

FLOAT_TAG = "tag:yaml.org,2002:float"
INT_TAG = "tag:yaml.org,2002:int"
BOOL_TAG = "tag:yaml.org,2002:bool"
TIMESTAMP_TAG = "tag:yaml.org,2002:timestamp"
MERGE_TAG = "tag:yaml.org,2002:merge"
# OmegaConf's float pattern for override values: YAML 1.1's needs a dot, so it reads 1e-4 as a string
YAML12_FLOAT = re.compile(r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)
# YAML 1.1's integers less its octal (010 is 8) and base 60 (1:30 is 90): a seed or count written 010 is 10, and
# where a string is meant (a run name, a split) it stays one, as written
YAML12_INT = re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0x[0-9a-fA-F_]+|[-+]?(?:0|[1-9][0-9_]*))$")
# YAML 1.2's booleans: YAML 1.1 also read yes/no/on/off, and a tokenizer, run name or project called `no` became
# false; a boolean setting still takes them (the schema reads the string)
YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
YAML12_PATTERNS = {FLOAT_TAG: YAML12_FLOAT, INT_TAG: YAML12_INT, BOOL_TAG: YAML12_BOOL}
# The first line of the configs megadiff writes: they are read as ConfigFileLoader reads (see read_saved_config)
SAVED_HEADER = "# megadiff: a resolved config (read with YAML 1.2 numbers)\n"
# Its second line: the working directory of the run that wrote it, which its relative paths (as the user typed
# them) are from. Read from another one (a Slurm job submitted elsewhere, a checkpoint copied), they named other
# files or none: a resume with the run's config.yaml started a new run there, an evaluation read other data.
WORKING_DIR_NOTE = "# megadiff: relative paths are from the working directory "
# the path settings of a saved config (some may be names too: a packaged tokenizer, a Hub dataset)
SAVED_PATH_KEYS = ("output_dir", "data.prefix", "data.sources", "data.blend", "data.cache_dir", "checkpoint.load",
                   "data.tokenizer", "deepspeed",
                   # an adaptation's (megadiff adapt)
                   "model.path", "model.tokenizer", "data.files", "export_dir")
# Keys naming a file shipped beside the config that sets them (configs/adapt/ -> ../deepspeed/zero2.json)
FILE_RELATIVE_KEYS = ("deepspeed", "data.chat_template")


FIRST_CHARACTERS = {FLOAT_TAG: "-+0123456789.", INT_TAG: "-+0123456789", BOOL_TAG: "tTfF"}


def implicit_resolvers(replaced: dict, kept: tuple[str, ...] = ()) -> dict:
    """PyYAML's safe implicit resolvers less its dates, with the `replaced` tags' patterns ({tag: pattern}) in
    place of its own (beside them for the `kept` tags)."""
    resolvers = {first: [(tag, pattern) for tag, pattern in candidates
                         if tag != TIMESTAMP_TAG and (tag not in replaced or tag in kept)]
                 for first, candidates in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    for tag, pattern in replaced.items():
        for first in FIRST_CHARACTERS[tag]:
            resolvers.setdefault(first, []).append((tag, pattern))
    return resolvers


class ConfigFileLoader(yaml.SafeLoader):
    """PyYAML's safe loader, reading scalars as OmegaConf reads override values, refusing duplicate keys."""

    yaml_implicit_resolvers = implicit_resolvers(YAML12_PATTERNS)

    def compose_mapping_node(self, anchor) -> yaml.MappingNode:
        # as written, before construction merges `<<` keys into the mappings (in place, for anchors)
        node = super().compose_mapping_node(anchor)
        self.refuse_duplicate_keys(node)
        return node

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        """YAML's merge keys, whatever PyYAML's release: a mapping's own keys win over merged ones, and of
        `<<: [*a, *b]` the earlier mapping's (PyYAML 6.0.4 lets *b win, and a nested merge's overridden value
        win for a one-letter key). In place, as PyYAML does: an anchored mapping is merged once."""
        merges = [value_node for key_node, value_node in node.value if key_node.tag == MERGE_TAG]
        # its own keys alone before merging in: a mapping merging itself (or an ancestor) ends there
        node.value = [pair for pair in node.value if pair[0].tag != MERGE_TAG]
        own, merged = node.value, []
        for value_node in merges:
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark,
                        f"expected a mapping or list of mappings for merging, but found {source.id}", source.start_mark)
                self.flatten_mapping(source)
                merged.append(source.value)
        if merged:  # a dict keeps a repeated key's last value
            node.value = [pair for source in reversed(merged) for pair in source] + own
        super().flatten_mapping(node)  # the rest of what PyYAML does there: a bare `=` key is the string "="

    @staticmethod
    def refuse_duplicate_keys(node: yaml.MappingNode) -> None:
        """PyYAML keeps the last of a repeated key, silently dropping the first (a whole section, say)."""
        first_lines = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE_TAG:
                continue
            key = key_node.value
            if key in first_lines:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (first on line {first_lines[key]})", key_node.start_mark)
            first_lines[key] = key_node.start_mark.line + 1


class ConfigFileDumper(yaml.SafeDumper):
    """Quotes the strings ConfigFileLoader or a YAML 1.1 reader (an earlier megadiff's) reads as other types
    ('1e-4', '010', 'no'), so a dumped config loads back the same in both."""

    yaml_implicit_resolvers = implicit_resolvers(YAML12_PATTERNS, kept=(FLOAT_TAG, INT_TAG, BOOL_TAG))


def describe_error(err: Exception) -> str:
    """A PyYAML or OmegaConf error in one line (theirs span several, naming "<unicode string>" or object types)."""
    if isinstance(err, yaml.MarkedYAMLError):
        return err.problem + (f" ({err.context})" if err.context else "")
    return first_line(err)


def read_yaml_file(path: Path, loader: type = ConfigFileLoader) -> dict:
    """One config file's top-level mapping; bad YAML is a ConfigError naming the file and line."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader) or {}
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}, line {mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: {describe_error(err)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def file_relative(value: str, directory: Path) -> str:
    """A relative path from the working directory, else from `directory` (made absolute there)."""
    # os.path, not Path: a chat_template may be a whole Jinja template, which os.path.exists just answers False
    if os.path.isabs(value) or os.path.exists(value) or not os.path.exists(directory / value):
        return value
    return str((directory / value).resolve())


def anchor_relative_paths(data: dict, directory: Path) -> None:
    """Point the FILE_RELATIVE_KEYS paths that `data` sets at files beside it, before inheritance merges
    files from other directories (in place)."""
    for dotted in FILE_RELATIVE_KEYS:
        section, name = _section_of(data, dotted)
        if isinstance(section, dict) and isinstance(section.get(name), str):
            section[name] = file_relative(section[name], directory)


def _section_of(data: dict, dotted: str) -> tuple[dict | None, str]:
    """(the mapping holding the dotted key in `data`, or None if there is none; the key's last name)."""
    *parents, name = dotted.split(".")
    section = data
    for parent in parents:
        section = section.get(parent) if isinstance(section, dict) else None
    return section, name


def load_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base: circular inheritance through {path}")
    if path.is_dir():
        raise ConfigError(f"{path} is a directory: give a config file (e.g. configs/diff-3b.yaml, or a run's "
                          "config.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = read_yaml_file(path)
    anchor_relative_paths(data, path.parent)
    anchor_saved_paths(data, path)  # a run's config.yaml, resumed from elsewhere
    if is_saved_config(path):  # resolved when it was written: a `${` in it is one its run's value holds
        data = as_written(data)
    base = data.pop("base", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"{path}: base must name a config file, got {base!r}")
    parent = load_yaml_tree((path.parent / base), seen + (path,))
    return OmegaConf.to_container(merge_layer(parent, data, str(path)))


def dropped_comment(value: str) -> str:
    """The YAML comment ending an override's value ('' if none), which OmegaConf would silently drop."""
    try:
        tokens = [token for token in yaml.scan(value, Loader=yaml.SafeLoader)
                  if not isinstance(token, (yaml.BlockEndToken, yaml.StreamEndToken))]
    except yaml.YAMLError:
        return ""  # parse_override reports it
    return value[tokens[-1].end_mark.index:].strip()  # what follows the value's last token


def parse_override(item: str) -> DictConfig:
    """One `key.sub=value` override as a tree; a malformed one is a ConfigError naming it."""
    key, equals, value = item.partition("=")
    parts = key.split(".")
    if not equals or not all(parts):
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    if index := next((i for i, part in enumerate(parts) if part.isdigit()), None):
        whole = ".".join(parts[:index])
        raise ConfigError(f"override {item!r}: a list's items are not set one by one; give the whole list "
                          f"({whole}=[...])")
    if comment := dropped_comment(value):
        raise ConfigError(f"override {item!r}: ' #' starts a YAML comment, which would drop {comment!r}; quote a "
                          f"value holding it (\"{key}='{value}'\") or leave the comment out")
    try:  # the value read as files are (OmegaConf's own reader takes 010 for 8 and no for false)
        tree = yaml.load(value, Loader=ConfigFileLoader)
        for part in reversed(parts):
            tree = {part: tree}
        return OmegaConf.create(tree)
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"override {item!r}: {describe_error(err)}") from None


def merge_layer(tree: dict | DictConfig, layer: dict | DictConfig, source: str) -> DictConfig:
    """`layer` merged over `tree`; a clash (a mapping given for a list, say) is a ConfigError naming `source`."""
    try:
        return OmegaConf.merge(tree, layer)
    except (OmegaConfBaseException, TypeError) as err:  # OmegaConf raises a bare TypeError for container clashes
        raise ConfigError(f"{source}: {describe_error(err)}") from None


def apply_overrides(data: dict, overrides: Iterable[str] = ()) -> dict:
    """`data` with the overrides applied in order, a later one winning, and `${...}` interpolations resolved."""
    try:
        tree = OmegaConf.create(data)
    except OmegaConfBaseException as err:  # a value OmegaConf cannot hold (a set), a key it refuses (null)
        raise ConfigError(f"{err.full_key or 'config'}: {describe_error(err)}") from None
    for item in overrides:
        tree = merge_layer(tree, parse_override(item), f"override {item!r}")
    try:
        return OmegaConf.to_container(tree, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{err.full_key}: {describe_error(err)}{environment_variable_hint(err)}") from None


# OmegaConf's message for a `${NAME}` that names no setting of the config
UNKNOWN_INTERPOLATION = re.compile(r"Interpolation key '([^']+)' not found")


def environment_variable_hint(err: Exception) -> str:
    """How to name an environment variable, where `${NAME}` was likely meant as one (a shell's `/scratch/${USER}`):
    OmegaConf reads it as another setting of the config, and its error says only that there is none."""
    match = UNKNOWN_INTERPOLATION.search(str(err))
    name = match.group(1) if match else ""
    if not (name in os.environ or re.fullmatch(r"[A-Z_][A-Z0-9_]*", name)):
        return ""
    return f" (${{{name}}} names a setting of the config; an environment variable is ${{oc.env:{name}}})"


def format_validation_error(err: ValidationError, schema: type[BaseModel]) -> str:
    """pydantic's errors of validating `schema`, a line per key; a misspelt key with the known one it is nearest."""
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"])
        message = unknown_key_message(schema, item["loc"]) if item["type"] == "extra_forbidden" \
            else item["msg"].removeprefix("Value error, ")
        lines.append(f"{key}: {message}")
    return "invalid config:\n  " + "\n  ".join(lines)


def unknown_key_message(schema: type[BaseModel], location: tuple) -> str:
    """'unknown key', with the key of the same section spelt most like it (train.lr_warmup: lr_warmup_iters)."""
    section = schema
    for part in location[:-1]:
        field = section.model_fields.get(part)
        section = field.annotation if field is not None else None
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            return "unknown key"
    nearest = difflib.get_close_matches(str(location[-1]), list(section.model_fields), n=1)
    if not nearest:
        return "unknown key"
    return f"unknown key (did you mean {'.'.join([*map(str, location[:-1]), nearest[0]])}?)"


# `${` where OmegaConf would start an interpolation, with the backslashes before it (OmegaConf's escapes)
INTERPOLATION_START = re.compile(r"(\\*)\$\{")


def as_written(data):
    """`data` (a saved config's tree) escaped so that OmegaConf reads every string as it is: a saved config is
    resolved already. Resolved again, a checkpoint's `${oc.env:HF_TOKEN}` (one downloaded) put the reader's
    token into what it wrote (an export's sidecar config, uploaded with it), and a value whose `${` was escaped
    in the run's config failed to load."""
    if isinstance(data, dict):
        return {key: as_written(value) for key, value in data.items()}
    if isinstance(data, list):
        return [as_written(value) for value in data]
    if isinstance(data, str):
        return INTERPOLATION_START.sub(lambda match: match.group(1) * 2 + "\\${", data)
    return data


def _validated(tree: dict) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, Config)) from None


def saved_config(data: dict, overrides: Iterable[str] = ()) -> Config:
    """A config a run saved (a checkpoint's, an export's sidecar, a Config's dump), with `overrides`, read against
    the schema alone: the checks of a run's settings (its schedule, the packages it logs or computes with) were
    that run's, and a resume, conversion or evaluation of its checkpoints does not repeat them (a later megadiff's
    stricter ones included). Its strings are taken as written (as_written); the overrides' `${...}` resolve."""
    return _validated(apply_overrides(as_written(data), overrides))


def build_config(data: dict, overrides: Iterable[str] = (), world_size: int | None = None) -> Config:
    """A config file's tree (its `${...}` resolved) with `overrides`, checked as a run's settings."""
    cfg = _validated(apply_overrides(data, overrides))
    validate_config(cfg, world_size)
    return cfg


def load_config(path: str | Path | None, overrides: Iterable[str] = (), world_size: int | None = None) -> Config:
    data = load_yaml_tree(Path(path)) if path is not None else {}
    return build_config(data, overrides, world_size)


def config_yaml(tree: dict) -> str:
    """A config tree as YAML that config files are read back from alike (strings such as 3e-4 quoted)."""
    return yaml.dump(tree, Dumper=ConfigFileDumper, sort_keys=False)


def dump_config(cfg: BaseModel, path: str | Path) -> None:
    """A run's resolved config (pre-training's Config, an adaptation's) as its config files are read back."""
    note = WORKING_DIR_NOTE + json.dumps(os.getcwd()) + "\n"
    Path(path).write_text(SAVED_HEADER + note + config_yaml(cfg.model_dump(mode="json")))


def _first_lines(path: Path) -> tuple[str, str]:
    with open(path, encoding="utf-8", errors="replace") as file:
        return file.readline(), file.readline()


def is_saved_config(path: Path) -> bool:
    """Whether dump_config wrote the file (a run's or checkpoint's config.yaml), as its first line says."""
    return _first_lines(path)[0] == SAVED_HEADER


def saved_working_dir(path: Path) -> str | None:
    """The working directory a saved config's note names (None: a config of a user's, or saved before notes)."""
    header, note = _first_lines(path)
    if header != SAVED_HEADER:
        return None
    return json.loads(note[len(WORKING_DIR_NOTE):]) if note.startswith(WORKING_DIR_NOTE) else None


def _names_something(path: str) -> bool:
    """Whether `path` names a file, a directory, or a data prefix's files (prefix.bin, prefix.idx)."""
    return os.path.exists(path) or bool(glob.glob(glob.escape(path) + ".*"))


def _from_working_dir(value, working_dir: str):
    """A relative path setting's value (a string, or a list's strings) from `working_dir` where it names nothing
    from here and something from there. Else as written: what a run copied elsewhere with its data (beside it
    as before) names here, a name (a packaged tokenizer, a Hub dataset), a path of neither."""
    if isinstance(value, list):
        return [_from_working_dir(item, working_dir) for item in value]
    if not isinstance(value, str) or not value or os.path.isabs(value) or _names_something(value):
        return value
    anchored = os.path.normpath(os.path.join(working_dir, value))
    return anchored if _names_something(anchored) else value


def anchor_saved_paths(data: dict, path: Path) -> None:
    """Point a saved config's relative paths at what they named where its run ran (in place); read there, they
    stay as written."""
    working_dir = saved_working_dir(path)
    if working_dir is None or os.path.realpath(working_dir) == os.path.realpath(os.getcwd()):
        return
    for dotted in SAVED_PATH_KEYS:
        section, name = _section_of(data, dotted)
        if isinstance(section, dict) and name in section:
            section[name] = _from_working_dir(section[name], working_dir)


def read_saved_config(path: str | Path) -> dict:
    """A config dump_config wrote (a run's or checkpoint's config.yaml, an export's sidecar). Those
    written before its header were for YAML 1.1 readers, leaving strings such as 3e-4 unquoted: they
    are read as they were written."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror}") from None
    data = read_yaml_file(path, ConfigFileLoader if text.startswith(SAVED_HEADER) else yaml.SafeLoader)
    anchor_saved_paths(data, path)
    if not isinstance(data.get("model"), dict):  # read as the schema's defaults, it described another model
        raise ConfigError(f"{path}: no model section: not a config megadiff wrote whole (emptied, or cut short by a "
                          "copy?)")
    return data
