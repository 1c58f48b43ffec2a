"""The records of a JSON-lines file a killed run may have cut mid-line (metrics.jsonl, trimmed on resume)."""

from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)


def read_json_lines(path: str) -> list[tuple[str, dict]]:
    """(line, record) for each JSON-object line of a file that a killed run may have left behind.

    A last line cut short (the run was killed while writing it) is dropped with a warning naming
    the file; a bad line before it raises ValueError naming the file and line. Each returned line
    ends with a newline, so records appended after them start on a line of their own.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [(number, line) for number, line in enumerate(f, start=1) if line.strip()]
    out = []
    for number, line in lines:
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not an object")
        except ValueError:
            if number < lines[-1][0]:
                raise ValueError(
                    f"{path}, line {number}: not a JSON record ({line.strip()[:60]!r}); fix or delete that line"
                ) from None
            logger.warning("%s: dropping its last line, cut short (%r)", path, line.strip()[:60])
            continue
        out.append((line.rstrip("\n") + "\n", record))
    return out
