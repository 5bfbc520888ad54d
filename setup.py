"""Packs the repository's configs/ into the wheel as megadiff/resources/configs, so that an installed
megadiff runs its demo and reads a `configs/chat/...` template without a checkout
(megadiff/config/bundled.py). Everything else is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithConfigs(build_py):
    def run(self):
        super().run()
        if not self.editable_mode:  # an editable install reads the checkout's configs/ where they are
            packed = Path(self.build_lib, "megadiff", "resources", "configs")
            shutil.rmtree(packed, ignore_errors=True)  # a build directory used before: no config deleted since
            shutil.copytree(Path(__file__).parent / "configs", packed)


setup(cmdclass={"build_py": BuildWithConfigs})
