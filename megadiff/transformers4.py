"""What config.json names for transformers 4.x as well as 5, for every Hugging Face directory megadiff writes
(conversions and adapted models)."""
from __future__ import annotations

import json
from pathlib import Path


def name_rope_for_transformers4(directory: Path, config) -> None:
    """transformers 5 keeps RoPE's base and scaling in `rope_parameters` alone, which 4.x does not read: it takes
    `rope_theta` and `rope_scaling`, and without them builds base-10000, unscaled RoPE silently (Llama 3.2's base
    500,000 and llama3 scaling lost, every logit changed), so config.json names both as 4.x reads them too."""
    rope = dict(config.rope_parameters or {})
    if "rope_theta" not in rope:
        return
    path = directory / "config.json"
    fields = json.loads(path.read_text())
    fields["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        fields["rope_scaling"] = rope
    path.write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
