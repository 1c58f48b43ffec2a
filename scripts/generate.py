"""Sample text from a trained checkpoint: the quickest look at what a model learned.

    ./run_llama_train.sh --checkpoint.enable_checkpoint     # the default run saves no checkpoint; this one does
    python scripts/generate.py outputs/debug_model/checkpoint/step-30 --prompt "def main(" \\
        [--max_new_tokens 64] [--temperature 0.8 --top_k 40] [--seed 0] [--no_cache]
    python scripts/generate.py --hf HF_DIR --prompt "..."          # a Hugging Face folder
    NGPU=2 torchrun --nproc_per_node 2 scripts/generate.py CKPT ...  # tensor parallel over the ranks

The model (family, shapes) comes from the checkpoint's marker (or the HF config.json); the tokenizer
from ``--tokenizer`` (default: the shipped one the debug configs train with). CPU without a GPU, else
CUDA. Greedy by default (temperature 0); with a KV cache unless ``--no_cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch  # noqa: E402

from torchtitan.components.generation import Sampling, generate  # noqa: E402

SHIPPED_TOKENIZER = "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"


def load_model(checkpoint: str | None, hf: str | None, max_len: int, n_words: int, device: torch.device):
    """The model (eval mode, on ``device``) from a checkpoint folder or, with ``hf``, an HF folder.

    ``max_len`` bounds prompt + generated tokens; ``n_words`` is the tokenizer's vocabulary size.

    Raises:
        ValueError: not a checkpoint of this trainer, or a vocabulary other than the tokenizer's.
    """
    weights, spec, model_args = _weights_and_model(checkpoint, hf, max_len)
    if model_args.vocab_size != n_words:
        raise ValueError(
            f"the model has a vocabulary of {model_args.vocab_size} and the tokenizer {n_words} words; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    return _build(spec, model_args, weights, device)


def _weights_and_model(checkpoint: str | None, hf: str | None, max_len: int):
    """(whole-model weights, model spec, ModelArgs) from a checkpoint folder or an HF folder."""
    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.spec import get_model_spec, spec_for_hf_model_type

    if hf:
        from safetensors.torch import load_file

        with open(os.path.join(hf, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        spec = spec_for_hf_model_type(config.get("model_type", "llama"))
        fields = spec.state_dict_adapter.model_args_from_hf(config)
        weights = spec.state_dict_adapter.from_hf_state_dict(load_file(os.path.join(hf, "model.safetensors")), fields)
    else:
        weights, marker = load_model_weights(checkpoint)
        info = marker.get("model") or {}
        if not info.get("args"):
            raise ValueError(f"{checkpoint}: its marker records no model args; it was not written by this trainer")
        spec, fields = get_model_spec(info.get("name") or "llama3"), info["args"]
    model_args = type(next(iter(spec.flavors.values()))).from_dict({**fields, "max_seq_len": max_len})
    return weights, spec, model_args


def _build(spec, model_args, weights, device: torch.device) -> torch.nn.Module:
    """The model on ``device`` with ``weights``; tensor parallel over the world when launched with several ranks."""
    with torch.device("meta"):
        model = spec.model_cls(model_args)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh

        from torchtitan.distributed.tensor_parallel import apply_tp_inference

        apply_tp_inference(model, init_device_mesh(device.type, (world,)))
        model.to_empty(device=device)
        model.init_buffers(device)
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    else:
        model.to_empty(device=device)
        model.init_buffers(device)
        model.load_state_dict(weights)
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="a complete checkpoint folder (step-N)")
    parser.add_argument("--hf", help="a Hugging Face folder (model.safetensors + config.json) instead")
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--tokenizer",
        default=SHIPPED_TOKENIZER,
        help="tokenizer the model was trained with: tiktoken BPE file or tokenizer.json (or its folder)",
    )
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_cache", action="store_true", help="run the whole sequence every step (the reference)")
    args = parser.parse_args(argv)
    if bool(args.checkpoint) == bool(args.hf):
        parser.error("give a checkpoint folder or --hf HF_DIR (one of them)")
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.distributed.device import get_device_info, init_distributed

    info = get_device_info()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed(info, 300, 0)
    try:
        tokenizer = build_tokenizer(args.tokenizer)
        prompt = tokenizer.encode(args.prompt, bos=True, eos=False)
        max_len = len(prompt) + args.max_new_tokens
        model = load_model(args.checkpoint, args.hf, max_len, tokenizer.n_words, info.device)
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = generate(
        model,
        torch.tensor([prompt], device=info.device),
        args.max_new_tokens,
        Sampling(args.temperature, args.top_k),
        use_cache=not args.no_cache,
        stop_token=tokenizer.eos_id,
        generator=torch.Generator(info.device).manual_seed(args.seed),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        print(tokenizer.decode(out[0, len(prompt) :].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
