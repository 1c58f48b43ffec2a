"""Train a byte-level BPE tokenizer and write it in tiktoken's file format.

Ranks 0..255 are the single bytes; each later rank is one merge, in the order learned. Text is
pre-tokenized with Llama 3's regex, so the result plugs into `TikTokenizer` like Llama 3's own file.

Usage:
    python scripts/train_tokenizer.py --vocab_size 2048 \
        --input torchtitan/datasets/assets/pydocs/pydocs.jsonl \
        --output torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken
"""

from __future__ import annotations

import argparse
import base64
import heapq
import json
import logging
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex
import tiktoken

# run as `python scripts/train_tokenizer.py` from anywhere: make the repo's package importable so
# the pre-tokenization regex has a single source of truth
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torchtitan.config.parse_errors import parsing  # noqa: E402
from torchtitan.datasets.tokenizer.tiktoken import PAT_STR, load_bpe_ranks  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_INPUT = "torchtitan/datasets/assets/pydocs/pydocs.jsonl"
DEFAULT_OUTPUT = "torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"

Pair = tuple[int, int]


def read_jsonl_texts(path: str, text_field: str = "text") -> list[str]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"corpus not found: {path!r}; build it with `python scripts/build_default_corpus.py`")
    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                with parsing(path, "valid JSON", line=number, fix="fix or remove that row"):
                    row = json.loads(line)
                texts.append(row[text_field])
    return texts


def count_words(texts: Iterable[str]) -> Counter[bytes]:
    """Frequency of each pre-tokenized piece (as UTF-8 bytes); merges never cross pieces."""
    pattern = regex.compile(PAT_STR)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(m.encode("utf-8") for m in pattern.findall(text))
    return counts


def _pairs(ids: list[int]) -> Counter[Pair]:
    return Counter(zip(ids, ids[1:]))


def _merge_word(ids: list[int], pair: Pair, new_id: int) -> list[int]:
    out: list[int] = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new_id)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


class _PairIndex:
    """Pair counts over the word table, with the words holding each pair, kept up to date per merge.

    The max-count pair comes from a lazy heap: stale entries (count changed since pushed) are
    skipped on pop, so each merge costs time proportional to the words it touches, not the corpus.
    """

    def __init__(self, words: list[list[int]], freqs: list[int]) -> None:
        self.words, self.freqs = words, freqs
        self.counts: dict[Pair, int] = defaultdict(int)
        self.where: dict[Pair, set[int]] = defaultdict(set)
        for wi, ids in enumerate(words):
            for pair, n in _pairs(ids).items():
                self.counts[pair] += n * freqs[wi]
                self.where[pair].add(wi)
        # ties broken by the smaller pair of ids, so training is deterministic
        self.heap = [(-c, p) for p, c in self.counts.items()]
        heapq.heapify(self.heap)

    def pop_best(self) -> Pair | None:
        while self.heap:
            neg_count, pair = heapq.heappop(self.heap)
            if self.counts.get(pair, 0) == -neg_count > 0:
                return pair
        return None

    def apply_merge(self, pair: Pair, new_id: int) -> None:
        changed: set[Pair] = set()
        for wi in sorted(self.where.pop(pair, ())):
            old = self.words[wi]
            new = _merge_word(old, pair, new_id)
            if len(new) == len(old):
                continue  # stale membership: an earlier merge already consumed this pair here
            delta = _pairs(new)
            delta.subtract(_pairs(old))
            for p, n in delta.items():
                if n:
                    self.counts[p] += n * self.freqs[wi]
                    changed.add(p)
                if n > 0:
                    self.where[p].add(wi)
            self.words[wi] = new
        for p in changed:
            heapq.heappush(self.heap, (-self.counts[p], p))


def train_bpe(word_counts: Counter[bytes], vocab_size: int) -> list[bytes]:
    """Learn merges until `vocab_size` ranks exist; returns token bytes indexed by rank."""
    if vocab_size < 256:
        raise ValueError(f"--vocab_size must be >= 256 (the single bytes), got {vocab_size}")
    vocab = [bytes([b]) for b in range(256)]
    rank_of = {tok: r for r, tok in enumerate(vocab)}
    words = sorted(word_counts)  # sorted: the word table order must not depend on dict order
    index = _PairIndex([list(w) for w in words], [word_counts[w] for w in words])
    while len(vocab) < vocab_size:
        pair = index.pop_best()
        if pair is None:
            logger.warning("corpus exhausted: only %d ranks learnable, wanted %d", len(vocab), vocab_size)
            break
        merged = vocab[pair[0]] + vocab[pair[1]]
        # the same bytes can arise from two splits (ab|c, a|bc); tiktoken keys ranks by bytes, so
        # reuse the existing rank instead of writing a duplicate line
        new_id = rank_of.get(merged)
        if new_id is None:
            new_id = len(vocab)
            vocab.append(merged)
            rank_of[merged] = new_id
        index.apply_merge(pair, new_id)
    return vocab


def write_tiktoken_bpe(vocab: list[bytes], path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="ascii", newline="\n") as f:
        for rank, token in enumerate(vocab):
            f.write(f"{base64.b64encode(token).decode('ascii')} {rank}\n")


def load_encoding(path: str) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name=Path(path).name, pat_str=PAT_STR, mergeable_ranks=load_bpe_ranks(path), special_tokens={}
    )


def check_round_trip(enc: tiktoken.Encoding, texts: list[str]) -> float:
    """Round-trip `texts` through tiktoken; returns bytes per token."""
    num_bytes = num_tokens = 0
    for text in texts:
        ids = enc.encode_ordinary(text)
        if enc.decode(ids) != text:
            raise RuntimeError(f"tiktoken round trip failed on text starting {text[:60]!r}")
        num_bytes += len(text.encode("utf-8"))
        num_tokens += len(ids)
    return num_bytes / max(num_tokens, 1)


def find_unreachable(enc: tiktoken.Encoding, vocab: list[bytes]) -> list[int]:
    """Ranks whose own bytes tiktoken does not encode to that single rank.

    tiktoken merges the lowest-rank adjacent pair whose concatenation is *any* rank, not only the
    learned pair, so a rank is only useful if that greedy order rebuilds it: this checks the merge
    order we wrote agrees with tiktoken's algorithm.
    """
    return [r for r, tok in enumerate(vocab) if enc._encode_single_piece(tok) != [r]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", default=DEFAULT_INPUT, help="JSONL corpus with a 'text' field")
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="tiktoken BPE file to write")
    parser.add_argument("--vocab_size", type=int, default=2048, help="BPE ranks, the 256 bytes included")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    texts = read_jsonl_texts(args.input)
    start = time.perf_counter()
    word_counts = count_words(texts)
    vocab = train_bpe(word_counts, args.vocab_size)
    elapsed = time.perf_counter() - start
    write_tiktoken_bpe(vocab, args.output)
    enc = load_encoding(args.output)
    bytes_per_token = check_round_trip(enc, texts)
    unreachable = find_unreachable(enc, vocab)
    if unreachable:
        logger.warning("%d ranks are unreachable by tiktoken's merge order: %s", len(unreachable), unreachable[:20])
    logger.info(
        "trained %d ranks on %d documents (%d unique pieces) in %.1fs; wrote %s; "
        "tiktoken round trip ok, all ranks reachable: %s, %.2f bytes/token",
        len(vocab),
        len(texts),
        len(word_counts),
        elapsed,
        args.output,
        not unreachable,
        bytes_per_token,
    )


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
