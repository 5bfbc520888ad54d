"""YAML + `key.sub=value` overrides -> a validated `Config`.

A YAML file may name `base: other.yaml` (relative to itself) to inherit from.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable

import yaml
from omegaconf import OmegaConf
from pydantic import ValidationError

from megadiff.config.schema import Config
from megadiff.config.validate import ConfigError, validate_config

REPO_CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def load_yaml_tree(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base: circular inheritance through {path}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    base = data.pop("base", None)
    if base is None:
        return data
    parent = load_yaml_tree((path.parent / base), seen + (path,))
    return OmegaConf.to_container(OmegaConf.merge(parent, data))


def format_validation_error(err: ValidationError) -> str:
    lines = []
    for item in err.errors():
        key = ".".join(str(p) for p in item["loc"])
        message = "unknown key" if item["type"] == "extra_forbidden" else item["msg"]
        lines.append(f"{key}: {message}")
    return "invalid config:\n  " + "\n  ".join(lines)


def build_config(data: dict, overrides: Iterable[str] = (), world_size: int | None = None) -> Config:
    overrides = list(overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
    merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(overrides))
    try:
        cfg = Config.model_validate(OmegaConf.to_container(merged, resolve=True))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None
    validate_config(cfg, world_size)
    return cfg


def load_config(path: str | Path | None, overrides: Iterable[str] = (), world_size: int | None = None) -> Config:
    data = load_yaml_tree(Path(path)) if path is not None else {}
    return build_config(data, overrides, world_size)


def dump_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
