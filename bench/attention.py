"""Block-causal vs causal attention: forward+backward tokens/s and peak memory, in one process.

Packs documents of random lengths (uniform in ``[--min_doc, --max_doc]``, fixed seed; each row's
last document is cut at ``--seq_len``) and times forward+backward of (1) the attention op alone,
(bs, n_heads, seq_len, head_dim) through the model's own ``CausalAttention``, and (2) the model
(``--flavor``: embedding, blocks and final norm; the output head is skipped, it does not depend on
the mask). The variants run in turn in every round, so machine noise hits them alike; each figure
is the median over rounds. Variants: ``causal`` (the whole window), ``block_causal`` (the backend
``model.attention_backend = 'auto'`` picks on this device: the per-document SDPA split on CPU,
FlexAttention on CUDA) and, with ``--with_mask``, ``masked`` (SDPA with the boolean block-causal
mask, the alternative to the split). Prints one JSON object; ratios are variant / causal and
block_causal / masked.

Peak memory is measured in a separate untimed pass: on CUDA the caching allocator's peak above
what was allocated before the pass; on CPU, where torch keeps no allocator statistics, the peak of
the tensors the pass allocates as torch's MemTracker sees them (op outputs; not a kernel's
internal scratch, not the process RSS that bench/float8.py reports).

    python -m bench.attention [--seq_len 2048] [--batch_size 2] [--min_doc 32] [--max_doc 256]
        [--flavor debugmodel] [--rounds 3] [--with_mask] [--skip_model]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed._tools import MemTracker

from torchtitan.distributed.backend.device import get_device_info, synchronize
from torchtitan.models.common.attention import masked_attention, resolve_attention_backend
from torchtitan.models.common.documents import document_stats
from torchtitan.models.llama.model import CausalAttention, Transformer
from torchtitan.spec import get_model_spec

VOCAB = 2048  # the debug tokenizer's (pydocs_bpe2048)


def draw_documents(batch_size: int, seq_len: int, lo: int, hi: int, seed: int) -> torch.Tensor:
    """(bs, seq_len) document ids of documents with lengths uniform in [lo, hi], the last one cut."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch_size):
        lengths, total = [], 0
        while total < seq_len:
            lengths.append(min(int(torch.randint(lo, hi + 1, (), generator=g)), seq_len - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


class MaskedAttention(nn.Module):
    """The ``masked`` variant in the model: swapped in at ``attention.sdpa`` (context parallel's seam)."""

    def forward(self, q, k, v, doc_ids=None):
        return masked_attention(q, k, v, doc_ids)


def op_variants(args, backend: str, doc_ids: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
    """name -> a forward+backward of the attention op alone, on q, k, v laid out as the model passes them."""
    bs, seq = doc_ids.shape
    g = torch.Generator(device=device).manual_seed(0)
    shapes = [(bs, seq, args.n_heads, args.head_dim)] + [(bs, seq, args.n_kv_heads, args.head_dim)] * 2
    # Token-major leaves seen through a transpose: (bs, heads, seq, head_dim) views, as Attention's
    leaves = [torch.randn(s, device=device, dtype=dtype, generator=g).requires_grad_() for s in shapes]
    kernel = CausalAttention(backend)

    def step(attention: Callable, **kw) -> Callable[[], None]:
        def run() -> None:
            q, k, v = (t.transpose(1, 2) for t in leaves)
            attention(q, k, v, **kw).float().square().mean().backward()

        return run

    variants = {"causal": step(kernel), "block_causal": step(kernel, doc_ids=doc_ids)}
    if args.with_mask:
        variants["masked"] = step(masked_attention, doc_ids=doc_ids)
    return variants


def model_variants(args, backend: str, doc_ids: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
    """name -> a forward+backward of the model (no output head), all variants on one set of weights."""
    flavor = get_model_spec("llama3").flavors[args.flavor]
    model_args = dataclasses.replace(flavor, vocab_size=VOCAB, max_seq_len=args.seq_len, attention_backend=backend)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(model_args)
        model.init_weights()
    model.to(dtype)
    tokens = torch.randint(0, VOCAB, tuple(doc_ids.shape), device=device)

    def step(masked: bool = False, **kw) -> Callable[[], None]:
        def run() -> None:
            kernels = [block.attention for block in model.layers.values()]
            saved = [a.sdpa for a in kernels]
            if masked:
                for a in kernels:
                    a.sdpa = MaskedAttention()
            try:
                model(tokens, return_hidden=True, **kw).float().square().mean().backward()
            finally:
                for a, s in zip(kernels, saved):
                    a.sdpa = s
            model.zero_grad(set_to_none=True)

        return run

    variants = {"causal": step(), "block_causal": step(doc_ids=doc_ids)}
    if args.with_mask:
        variants["masked"] = step(masked=True, doc_ids=doc_ids)
    return variants


def time_variants(variants: dict[str, Callable[[], None]], device: torch.device, rounds: int, warmup: int) -> dict:
    """name -> median seconds of one call; every round runs every variant once, in turn."""
    for fn in variants.values():
        for _ in range(warmup):  # FlexAttention compiles on its first call
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes of the tensors ``fn`` allocates, above what is live before it."""
    if device.type == "cuda":  # device-choice: naming the tracker, not choosing the device
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    tracker = MemTracker()
    with tracker:
        fn()
    return sum(stats["Total"] for stats in tracker.get_tracker_snapshot("peak").values())


def measure(variants: dict, tokens: int, device: torch.device, args) -> dict:
    seconds = time_variants(variants, device, args.rounds, args.warmup)
    out = {
        name: {"seconds": round(s, 4), "tokens_per_s": round(tokens / s, 1), "peak_mib": round(peak_bytes(fn, device) / 2**20, 2)}
        for (name, fn), s in zip(variants.items(), seconds.values())
    }  # fmt: skip
    return {**out, "ratios": ratios(out)}


def ratios(results: dict) -> dict:
    pairs = [(n, "causal") for n in results if n != "causal"]
    if "masked" in results:
        pairs.append(("block_causal", "masked"))
    return {
        f"{a}/{b}": {
            "tokens_per_s": round(results[a]["tokens_per_s"] / results[b]["tokens_per_s"], 3),
            "peak_memory": round(results[a]["peak_mib"] / results[b]["peak_mib"], 3),
        }
        for a, b in pairs
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--min_doc", type=int, default=32, help="shortest document (tokens)")
    p.add_argument("--max_doc", type=int, default=256, help="longest document (tokens)")
    p.add_argument("--seed", type=int, default=0, help="seed of the document lengths")
    p.add_argument("--n_heads", type=int, default=8, help="attention op alone: query heads")
    p.add_argument("--n_kv_heads", type=int, default=8, help="attention op alone: key/value heads")
    p.add_argument("--head_dim", type=int, default=64, help="attention op alone")
    p.add_argument("--flavor", default="debugmodel", help="llama3 flavor of the model pass")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--with_mask", action="store_true", help="also time SDPA with the boolean block-causal mask")
    p.add_argument("--skip_model", action="store_true", help="time the attention op only")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    device = get_device_info().device  # the trainer's one device choice
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))  # device-choice
    backend = resolve_attention_backend("auto", device.type)
    doc_ids = draw_documents(args.batch_size, args.seq_len, args.min_doc, args.max_doc, args.seed).to(device)
    tokens = doc_ids.numel()
    causal_pairs = args.batch_size * args.seq_len * (args.seq_len + 1) // 2
    _, documents, pairs = document_stats(doc_ids).tolist()
    report = {
        "benchmark": "attention",
        "device": str(device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "block_causal_backend": backend,
        "memory_tracker": "cuda max_memory_allocated" if device.type == "cuda" else "MemTracker tensor peak",
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "documents": documents,
        "document_lengths": [args.min_doc, args.max_doc],
        "visible_pairs_fraction": round(pairs / causal_pairs, 4),
        "settings": vars(args),
        "op": measure(op_variants(args, backend, doc_ids, device, dtype), tokens, device, args),
    }
    if not args.skip_model:
        report["model"] = measure(model_variants(args, backend, doc_ids, device, dtype), tokens, device, args)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
