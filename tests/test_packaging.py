"""megadiff installed from a wheel (built from the sdist, as pip builds a downloaded one) finds its own
configs without a checkout: the demo's config and the chat templates."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from megadiff.config.bundled import BUNDLED_CONFIGS

ROOT = Path(__file__).resolve().parents[1]


def _project_files() -> list[str]:
    """What a clean clone holds: the tracked files and those about to be (not the ignored builds)."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (ROOT / name).is_file()]


@pytest.fixture(scope="module")
def distributions(tmp_path_factory) -> tuple[Path, Path]:
    """(sdist, wheel built from that sdist)."""
    root = tmp_path_factory.mktemp("packaging")
    source, dist = root / "source", root / "dist"
    for name in _project_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(dist)!r})"],
                   cwd=source, capture_output=True, text=True, check=True)
    sdist = next(dist.glob("megadiff-*.tar.gz"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(sdist)], cwd=root, capture_output=True, text=True, check=True)
    return sdist, next(dist.glob("megadiff-*.whl"))


def test_a_checkout_reads_its_own_configs():
    assert BUNDLED_CONFIGS == ROOT / "configs"


def test_the_sdist_and_the_wheel_carry_the_configs_and_the_license(distributions):
    sdist, wheel = distributions
    with tarfile.open(sdist) as archive:
        in_sdist = {member.name.split("/", 1)[1] for member in archive.getmembers() if member.isfile()}
    assert {"configs/demo/diff-tiny.yaml", "configs/chat/chatml.jinja", "tests/conftest.py", "LICENSE",
            "setup.py"} <= in_sdist
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    shipped = {name.removeprefix("megadiff/resources/") for name in in_wheel if name.startswith("megadiff/resources/")}
    assert shipped == {name for name in in_sdist if name.startswith("configs/")}
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in in_wheel)
    assert "megadiff/convert/hf_code/modeling_megadiff.py" in in_wheel


@pytest.mark.slow
def test_an_installed_wheel_runs_the_demo_config_and_a_chat_template_from_anywhere(distributions, tmp_path):
    _, wheel = distributions
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   capture_output=True, text=True, check=True)
    elsewhere = tmp_path / "elsewhere"  # no configs/ here, and the checkout's are not beside the package
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run([sys.executable, "-c", "import megadiff.demo as d; print(d.__file__); print(d.DEMO_CONFIG)"],
                           cwd=elsewhere, env=env, capture_output=True, text=True, check=True).stdout.split()
    assert [Path(path).is_relative_to(target) for path in where] == [True, True], where
    params = subprocess.run([sys.executable, "-m", "megadiff", "params", where[1], "data.messages_key=messages",
                             "data.chat_template=configs/chat/chatml.jinja"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=300)
    assert params.returncode == 0 and "parameters" in params.stdout, params.stdout + params.stderr
