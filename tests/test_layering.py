"""The dependency direction the README promises, checked on the source and on what an import loads:
`ops` is pure torch (+ triton) and knows no megatron; `models` builds on `ops` and megatron-core;
`checkpoint` and `convert` on `models`, never on the commands (`inference`, `training`) that use them;
`adapt` works on Hugging Face models alone (no megatron); the CLI parses and calls, importing its
commands only when one runs; nothing in megadiff imports tests."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megadiff"
# what each part of megadiff may import of megadiff itself (its own modules always)
ALLOWED = {
    "ops": set(),
    "files": set(),  # atomic writes, locks, paths: the standard library alone, for any part to use
    "transformers4": set(),  # what config.json names for transformers 4.x: the standard library alone
    "config": {"errors", "files"},
    "models": {"config", "ops", "errors"},
    # a checkpoint's single-process model is built here, below both convert and inference, which use it
    "checkpoint": {"config", "data", "errors", "files", "helper_processes", "models", "parallel"},
    "convert": {"checkpoint", "config", "console", "data", "errors", "files", "models", "transformers4"},
    "cli": {"config", "console", "errors"},  # console: what a command does once its output's reader went away
}


def imports_of(path: Path) -> set[str]:
    """Absolute module names a file imports, wherever in it (functions included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "megadiff":
            # `from megadiff import ops` imports the part; `from megadiff import __version__` none
            names.update(f"megadiff.{alias.name}" for alias in node.names if not alias.name.startswith("__"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def part_of(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def test_each_part_imports_only_the_parts_below_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        for name in imports_of(path):
            top, _, rest = name.partition(".")
            if top == "tests":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            elif part in ALLOWED and top == "megadiff" and rest.split(".")[0] not in ALLOWED[part] | {part}:
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
            elif part in ("ops", "adapt") and top == "megatron":
                wrong.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not wrong, "\n".join(wrong)


def loaded_by(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `module`."""
    code = f"import sys, {module}; print('\\n'.join(sorted(sys.modules)))"
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()


@pytest.mark.parametrize("module,forbidden", [
    ("megadiff.ops", ("megatron", "megadiff.models", "megadiff.config")),
    ("megadiff.adapt.finetune", ("megatron", "megadiff.models", "megadiff.training", "megadiff.checkpoint")),
    ("megadiff.adapt.export", ("megatron", "megadiff.models", "megadiff.convert")),
    ("megadiff.cli", ("megatron", "torch", "megadiff.models", "megadiff.training", "megadiff.inference")),
    # what every rank's spawned checkpoint helper imports: torch took it 3 s a run
    ("megadiff.helper_processes", ("torch", "megatron")),
])
def test_importing_a_part_loads_nothing_it_must_not_know(module, forbidden):
    """What the source test cannot see: the imports of the modules it imports."""
    loaded = [name for name in loaded_by(module) if name.split(".")[0] in ("megatron", "torch", "megadiff")]
    assert not [name for name in loaded if name.startswith(forbidden)], module
