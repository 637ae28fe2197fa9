"""A reader of the run files W&B writes offline (``run-<id>.wandb``), for the tests.

wandb ships no public reader of these files: the one it had (``wandb.sdk.internal.datastore``,
an internal module) left the package when its Go core took over writing them. The format is
public, and so is its schema: a 7-byte header (``:W&B``, the magic 0xBEE1, version 0), then
LevelDB's log format (32 KiB blocks of records: CRC-32C, length, type FULL/FIRST/MIDDLE/LAST),
each record a ``wandb.proto.wandb_internal_pb2.Record`` message. This reader checks the header
and the framing and decodes the messages with that schema; it does not check the CRCs.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

_HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every record of the run file at ``path``, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[: len(_HEADER)] == _HEADER, f"{path} is not a W&B run file"
    out: list[Any] = []
    pos, parts = len(_HEADER), b""
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # a block's tail too short for a record header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:  # zero padding up to the block's end
            pos += room
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        assert kind in (_FULL, _FIRST, _MIDDLE, _LAST), f"bad record type {kind} in {path}"
        if kind in (_FULL, _FIRST):
            parts = b""
        parts += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            out.append(record)
    return out


def read_run(folder: Path) -> dict[str, Any]:
    """What an offline run's folder holds: ``id``, ``name``, ``group``, ``tags``, ``config``
    (a dict), ``history`` (one dict per ``log()``, with ``_step``), ``summary`` (a dict) and
    ``exit_code`` (``None`` if the run was not finished)."""
    import json

    (path,) = folder.glob("run-*.wandb")
    run: dict[str, Any] = {"history": [], "summary": {}, "config": {}, "exit_code": None}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, name=r.display_name, group=r.run_group, tags=list(r.tags))
            for item in r.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            run["history"].append(row)
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                run["summary"][key] = json.loads(item.value_json)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run
