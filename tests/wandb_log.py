"""Reading back what a run logged to W&B offline, from W&B's own transaction log (*.wandb)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

LOG_BLOCK = 32768  # W&B's .wandb files use LevelDB's log format: 32 KiB blocks of framed records
FULL, LAST = 1, 4


def wandb_records(path: Path):
    """The protobuf Records of a .wandb file (header ':W&B' + magic + version, then LevelDB log records)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left_in_block = LOG_BLOCK - position % LOG_BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left_in_block >= 7 else (0, 0, 0)
        if kind == 0:  # block trailer padding
            position += left_in_block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def logged_history_and_config(run_dirs: list[Path]) -> tuple[list[dict], dict]:
    history, config = [], {}
    for run_dir in run_dirs:
        for record in wandb_records(next(run_dir.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                history.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                                for item in record.history.item})
            elif kind in ("run", "config"):  # the config given to wandb.init comes with the run record
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in updates})
    return history, config


def exit_codes(run_dirs: list[Path]) -> list[int]:
    """The exit code each offline run recorded as it finished (0: W&B shows it finished, else failed)."""
    return [record.exit.exit_code for run_dir in run_dirs for record in wandb_records(next(run_dir.glob("*.wandb")))
            if record.WhichOneof("record_type") == "exit"]
