"""The command line's own surface: `megadiff --version` is the installed package's version."""
from __future__ import annotations

from importlib.metadata import version

import pytest

from megadiff.cli import main


def test_version_is_the_installed_distributions(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"megadiff {version('megadiff')}"
