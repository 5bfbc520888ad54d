"""Where megadiff's own configs are (the demo's, the chat templates): the copy a wheel carries in
megadiff/resources/configs (setup.py puts it there), else the repository's configs/ beside the package
of a checkout or an editable install."""
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]
_PACKAGED = _PACKAGE / "resources" / "configs"
BUNDLED_CONFIGS = _PACKAGED if _PACKAGED.is_dir() else _PACKAGE.parent / "configs"
