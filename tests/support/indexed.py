"""Small corpora for the indexed-dataset tests: jsonl files written by the test, tokenized with the shipped tokenizer."""

from __future__ import annotations

import json
import os

from tests.support.runs import ROOT
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH

TOKENIZER = os.path.join(ROOT, DEFAULT_TOKENIZER_PATH)


def write_jsonl(path, texts: list[str]) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")
    return str(path)
