"""The data layer's throughput and memory, one rank, as one JSON object (numbers in docs/performance.md).

1. **Loader from the page cache**, seq_len x batch (default 2048 x 8), one data-parallel rank: samples/s and
   tokens/s of the indexed reader (a synthetic corpus of ``--corpus_gb`` GB of uint16 ids, random documents,
   written once and read once to warm the page cache) vs today's text path (the shipped pydocs.jsonl, tokenized
   on the fly); the process's RSS before the loader, after building it and after reading, for the indexed one
   (target: >= 20 M tokens/s, RSS <= 200 MB above the process before the loader).
2. **scripts/tokenize_data.py**: tokens/s with 1 and 2 workers on the shipped corpus and on it repeated
   ``--repeat`` times (loading the rows included), the scaling, and whether the outputs are byte-identical.

    python -m bench.data [--corpus_gb 1.0] [--seq_len 2048] [--batch_size 8] [--seconds 5] [--work_dir /tmp/...]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from torchtitan.datasets.hf_datasets import compute_stream_groups
from torchtitan.datasets.indexed.format import IndexedWriter
from torchtitan.datasets.indexed.tokenize import tokenize_to_indexed
from torchtitan.datasets.text_loader import build_text_data_loader
from torchtitan.datasets.tokenizer import DEFAULT_TOKENIZER_PATH, build_tokenizer

REPO = Path(__file__).resolve().parent.parent

TOKENIZER = str(REPO / DEFAULT_TOKENIZER_PATH)
CORPUS = str(REPO / "torchtitan/datasets/assets/pydocs/pydocs.jsonl")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def write_synthetic(prefix: str, gb: float, vocab: int) -> int:
    """Random documents (100-4000 tokens, each ending in EOS = vocab - 1) up to ``gb`` GB of uint16 ids."""
    rng = np.random.default_rng(0)
    writer, target = IndexedWriter(prefix, np.uint16), int(gb * 1e9) // 2
    while writer.num_tokens < target:
        lengths = rng.integers(100, 4000, size=4096).astype(np.int32)
        tokens = rng.integers(0, vocab - 1, size=int(lengths.sum()), dtype=np.uint16)
        tokens[np.cumsum(lengths) - 1] = vocab - 1
        writer.add_documents(tokens, lengths)
    writer.finish()
    return writer.num_tokens


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def time_loader(loader, seconds: float, batch: int, seq_len: int) -> dict:
    it = iter(loader)
    next(it)  # the first batch builds what the loader builds lazily
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        inputs, _ = next(it)
        n += 1
    elapsed = time.perf_counter() - start
    samples = n * batch / elapsed
    return {"batches": n, "samples_per_s": round(samples, 1), "tokens_per_s": round(samples * seq_len)}


def bench_loaders(args, tokenizer, work: Path) -> dict:
    groups = compute_stream_groups(0, 1, args.batch_size, 1)
    prefix = str(work / "synthetic")
    t0 = time.perf_counter()
    tokens = write_synthetic(prefix, args.corpus_gb, tokenizer.n_words)
    written = time.perf_counter() - t0
    warm(prefix + ".bin")
    before = rss_mb()
    loader = build_text_data_loader("pydocs", prefix, tokenizer, args.seq_len, groups, args.batch_size)
    built = rss_mb()
    indexed = time_loader(loader, args.seconds, args.batch_size, args.seq_len)
    after = rss_mb()
    indexed.update(
        corpus_tokens=tokens,
        corpus_bytes=os.path.getsize(prefix + ".bin"),
        corpus_write_s=round(written, 1),
        rss_before_loader_mb=round(before, 1),
        rss_after_build_mb=round(built, 1),
        rss_after_reading_mb=round(after, 1),
        rss_growth_mb=round(after - before, 1),
    )
    del loader
    text_loader = build_text_data_loader("pydocs", CORPUS, tokenizer, args.seq_len, groups, args.batch_size)
    text = time_loader(text_loader, args.seconds, args.batch_size, args.seq_len)
    return {"indexed": indexed, "text_jsonl": text, "speedup": round(indexed["tokens_per_s"] / text["tokens_per_s"], 1)}


def bench_tokenize(work: Path, corpus: str) -> dict:
    out = {}
    for workers in (1, 2):
        summary = tokenize_to_indexed(
            corpus, str(work / f"pydocs_w{workers}"), TOKENIZER, workers=workers, progress=io.StringIO()
        )
        out[f"workers_{workers}"] = {
            "documents": summary.documents,
            "tokens": summary.tokens,
            "seconds": round(summary.seconds, 2),
            "tokens_per_s": round(summary.tokens / summary.seconds),
        }
    same = all((work / f"pydocs_w1{s}").read_bytes() == (work / f"pydocs_w2{s}").read_bytes() for s in (".bin", ".idx"))
    out["scaling_2_over_1"] = round(out["workers_2"]["tokens_per_s"] / out["workers_1"]["tokens_per_s"], 2)
    out["byte_identical"] = same
    return out


def repeated(work: Path, times: int) -> str:
    """The shipped corpus ``times`` times over in one jsonl: enough work to amortise starting the worker pool."""
    path = work / f"pydocs_x{times}.jsonl"
    text = Path(CORPUS).read_text(encoding="utf-8")
    path.write_text(text * times, encoding="utf-8")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus_gb", type=float, default=1.0)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=10, help="also tokenize the corpus repeated this many times")
    parser.add_argument("--work_dir", default="/tmp/torchtitan_bench_data")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(TOKENIZER)
    try:
        result = {
            "machine": {"cpus": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 2)},
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "loader": bench_loaders(args, tokenizer, work),
            "tokenize_data": bench_tokenize(work, CORPUS),
            f"tokenize_data_corpus_x{args.repeat}": bench_tokenize(work, repeated(work, args.repeat)),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
