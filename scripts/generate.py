"""Sample text from a trained checkpoint: the quickest look at what a model learned.

    ./run_llama_train.sh --checkpoint.enable_checkpoint     # the default run saves no checkpoint; this one does
    python scripts/generate.py outputs/debug_model/checkpoint/step-30 --prompt "def main(" \\
        [--max_new_tokens 64] [--temperature 0.8 --top_k 40] [--seed 0] [--no_cache]
    python scripts/generate.py --hf HF_DIR --prompt "..."          # a Hugging Face folder
    python scripts/generate.py --hf HF_DIR --adapter PEFT_DIR --prompt "..."   # + a PEFT LoRA adapter, merged
    python scripts/generate.py outputs/sft_debug/checkpoint/step-60 --chat \\
        --prompt "What is 12 plus 7?" [--system "Answer with the number only."]   # a chat model
    python scripts/generate.py CKPT --chat --image shape.png --prompt "What colour is the shape?"   # an image model
    NGPU=2 torchrun --nproc_per_node 2 scripts/generate.py CKPT ...  # tensor parallel over the ranks
    python scripts/generate.py CKPT --prompt "..." --speculative mtp  # DeepSeek-V3's MTP depths draft (greedy)

A LoRA run's checkpoint (adapters only) is merged into the base its marker names. The model (family, shapes)
comes from the checkpoint's marker (or the HF config.json); the tokenizer
from ``--tokenizer`` (default: the one the checkpoint's run trained with, which its marker records; an HF
folder's own tokenizer.json, as transformers reads it; else the shipped one the debug configs train with). CPU without a GPU, else
CUDA. Greedy by default (temperature 0); with a KV cache unless ``--no_cache``. ``--speculative mtp`` (greedy, batch
size 1, one process): a DeepSeek-V3 model's multi-token-prediction depths draft and the model checks
(``components/generation/speculative.py``, docs/models.md); the same text, then a line of drafted and accepted
tokens and tokens/s.

Plain, the prompt is text to continue, framed as the tokenizer frames a prompt (``Tokenizer.encode_prompt``): a
Hugging Face tokenizer as transformers' ``tokenizer(text)`` does (its own special tokens: a bos only where its
post-processor adds one, not because its config names a ``bos_token``), a tiktoken file after its bos; generation
stops at eos and the continuation is printed as decoded. With ``--chat`` the prompt is a user message: it is
rendered (after ``--system``, if given) with the tokenizer's chat template, or the built-in ChatML
one when it has none, and the assistant's header, as transformers' ``apply_chat_template(...,
add_generation_prompt=True)`` renders it. Generation stops at the end of the assistant's turn (eos,
or ``<|im_end|>`` / ``<|eot_id|>``), and only the answer is printed, without special tokens. ``--chat``
needs a Hugging Face tokenizer (``tokenizer.json`` + ``tokenizer_config.json``). ``--image PATH`` (with
``--chat``, repeatable; image models: ``qwen3_5_vl``) shows the images in the user's message before its text,
processed as in training (the tokenizer folder's ``preprocessor_config.json``; docs/vision.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import jinja2  # noqa: E402
import torch  # noqa: E402

from torchtitan.components.generation import KVCache, Sampling, generate  # noqa: E402

SHIPPED_TOKENIZER = "./torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken"


def load_model(
    checkpoint: str | None, hf: str | None, max_len: int, n_words: int, device: torch.device, adapter: str | None = None
):
    """The model (eval mode, on ``device``) from a checkpoint folder or, with ``hf``, an HF folder; ``adapter``: a
    PEFT LoRA folder merged into those weights.

    ``max_len`` bounds prompt + generated tokens; ``n_words`` is the tokenizer's vocabulary size (an HF model's
    table may be padded past it, as the trainer accepts: the padding rows' logits are dropped).

    Raises:
        ValueError: not a checkpoint of this trainer, or a vocabulary other than the tokenizer's.
    """
    weights, spec, model_args = _weights_and_model(checkpoint, hf, max_len)
    return build_loaded(weights, spec, model_args, n_words, device, adapter)


def build_loaded(weights, spec, model_args, n_words: int, device: torch.device, adapter: str | None = None):
    """``load_model`` from weights and args already read (``_weights_and_model``)."""
    if adapter:
        from torchtitan.features.lora.peft_io import (
            check_adapters_fit_base,
            merge_adapters,
            read_peft_folder,
            scaling_of,
        )

        config, adapters = read_peft_folder(adapter, spec, dataclasses.asdict(model_args))
        check_adapters_fit_base(adapters, weights, adapter)
        weights = merge_adapters(weights, adapters, scaling_of(config))
    if model_args.vocab_size < n_words:  # more rows is an HF model's padded table: the extra rows are never sampled
        raise ValueError(
            f"the model has a vocabulary of {model_args.vocab_size} and the tokenizer {n_words} words; "
            "pass the tokenizer the model was trained with (--tokenizer)"
        )
    model = _build(spec, model_args, weights, device)
    if model_args.vocab_size > n_words:
        model.register_forward_hook(lambda _m, _args, logits: _full(logits)[..., :n_words])
    return model


def _weights_and_model(checkpoint: str | None, hf: str | None, max_len: int):
    """(whole-model weights, model spec, ModelArgs) from a checkpoint folder or an HF folder."""
    from torchtitan.checkpointing.common import load_model_weights
    from torchtitan.spec import get_model_spec, spec_for_hf_model_type

    if hf:
        from torchtitan.checkpointing.hf.files import load_hf_weights, read_hf_config

        # a model_type no family of ours reads: transformers' own class, as model.name = "hf" trains and exports it
        spec = spec_for_hf_model_type(read_hf_config(hf).get("model_type", "llama"), any_family=True)
        if spec.state_dict_adapter is None:
            raise NotImplementedError(f"--hf {hf}: model family {spec.name} has no Hugging Face adapter")
        fields, weights = load_hf_weights(hf, spec.state_dict_adapter)
    else:
        weights, marker = load_model_weights(checkpoint)
        info = marker.get("model") or {}
        if not info.get("args"):
            raise ValueError(f"{checkpoint}: its marker records no model args; it was not written by this trainer")
        spec, fields = get_model_spec(info.get("name") or "llama3"), info["args"]
        if info.get("lora"):  # a LoRA run's checkpoint holds its adapters: merge them into the recorded base
            from torchtitan.features.lora.hf_export import merged_weights

            weights = merged_weights(weights, info, checkpoint)
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

        from torchtitan.distributed.tensor_parallel.plan import apply_tp_inference

        apply_tp_inference(model, init_device_mesh(device.type, (world,)))
        model.to_empty(device=device)
        model.init_buffers(device)
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    else:
        model.to_empty(device=device)
        model.init_buffers(device)
        model.load_state_dict(weights)
    return model.eval()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", help="a complete checkpoint folder (step-N)")
    parser.add_argument("--hf", help="a Hugging Face folder (model.safetensors + config.json) instead")
    parser.add_argument("--adapter", help="a PEFT LoRA adapter folder (adapter_config.json + safetensors) to merge in")
    parser.add_argument("--prompt", required=True, help="text to continue; with --chat, the user's message")
    parser.add_argument(
        "--tokenizer",
        help="tokenizer the model was trained with: tiktoken BPE file or tokenizer.json (or its folder); default: "
        "the one the checkpoint's run recorded, the --hf folder's own tokenizer when it has one, else the shipped one "
        "the debug configs train with",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="the prompt is a user message, rendered with the tokenizer's chat template; print only the answer",
    )
    parser.add_argument("--system", help="with --chat: a system message before the user's")
    parser.add_argument(
        "--image",
        action="append",
        metavar="PATH",
        help="with --chat: an image the user's message shows before its text (repeat for several; image models)",
    )
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no_cache", action="store_true", help="run the whole sequence every step (the reference)")
    parser.add_argument(
        "--speculative",
        choices=["mtp"],
        help="mtp: greedy decoding with a DeepSeek-V3 model's multi-token-prediction depths drafting the next tokens "
        "and the model checking them in one forward (the same tokens as plain greedy decoding); then prints a line "
        "with the drafted and accepted tokens and tokens/s. Batch size 1, one process, with the cache",
    )
    return parser


# a NamedTuple, not a dataclass: tests load this script by path, outside sys.modules, where a
# dataclass cannot resolve its string annotations
class Prompt(NamedTuple):
    """A run's prompt ids and vocabulary size, the ids that end its answer (generation stops at the
    first of them), and how generated ids become the printed text."""

    ids: list[int]
    n_words: int
    stop_ids: tuple[int, ...]
    to_text: Callable[[list[int]], str]


def build_prompt(args: argparse.Namespace) -> Prompt:
    """The prompt of a plain run (the text as the tokenizer frames a prompt) or of a ``--chat`` run (a rendered user
    turn, the template writing its own special tokens).

    Raises:
        ValueError: ``--chat`` with a tiktoken tokenizer, or a tokenizer without a usable chat template.
        FileNotFoundError: no tokenizer at ``--tokenizer``.
        jinja2.TemplateError: the chat template fails on the conversation.
    """
    from torchtitan.datasets.tokenizer import build_tokenizer
    from torchtitan.datasets.tokenizer.hf_tokenizer import is_hf_tokenizer_path

    if not args.chat:
        tokenizer = build_tokenizer(args.tokenizer)
        ids = tokenizer.encode_prompt(args.prompt)
        return Prompt(ids, tokenizer.n_words, (tokenizer.eos_id,), tokenizer.decode)
    if not is_hf_tokenizer_path(args.tokenizer):
        raise ValueError(
            f"--chat needs a Hugging Face tokenizer with a chat template, but --tokenizer {args.tokenizer} is a "
            "tiktoken file, which has none; pass --tokenizer a folder with tokenizer.json and tokenizer_config.json "
            "(such as tests/assets/sft/tokenizer), or drop --chat"
        )
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.datasets.sft.prompting import chat_prompt_ids, chat_stop_ids, decode_answer

    tokenizer = ChatTokenizer(args.tokenizer)
    ids = chat_prompt_ids(tokenizer, args.prompt, system=args.system)
    stop_ids = chat_stop_ids(tokenizer)
    return Prompt(ids, tokenizer.base.n_words, stop_ids, lambda out: decode_answer(tokenizer, out, stop_ids))


def image_prompt_and_model(args: argparse.Namespace, device: torch.device) -> tuple[Prompt, torch.nn.Module]:
    """A ``--chat --image`` run's prompt (the images laid out as in training) and the model bound to its images
    (``ImagePrompt``: generation continues from the prompt's last multimodal position)."""
    from torchtitan.datasets.sft.chat_template import ChatTokenizer
    from torchtitan.datasets.sft.prompting import chat_stop_ids, decode_answer
    from torchtitan.datasets.vision.prompting import image_prompt
    from torchtitan.models.qwen3_5.multimodal import ImagePrompt
    from torchtitan.observability.logging import quiet_torchao_import

    tokenizer = ChatTokenizer(args.tokenizer)
    weights, spec, model_args = _weights_and_model(args.checkpoint, args.hf, 1)
    with quiet_torchao_import():  # transformers' image processor is the first import of transformers (and torchao)
        ids, pixels, grids = image_prompt(tokenizer, model_args, args.image, args.prompt, system=args.system)
    model_args = dataclasses.replace(model_args, max_seq_len=len(ids) + args.max_new_tokens)
    model = build_loaded(weights, spec, model_args, tokenizer.base.n_words, device, args.adapter)
    stop_ids = chat_stop_ids(tokenizer)
    prompt = Prompt(ids, tokenizer.base.n_words, stop_ids, lambda out: decode_answer(tokenizer, out, stop_ids))
    return prompt, ImagePrompt(model, pixels.to(device), grids)


def default_tokenizer(hf: str | None, checkpoint: str | None) -> str:
    """Without ``--tokenizer``: the one a checkpoint's run trained with (its marker records it), an HF folder's own
    (as transformers reads it), else the shipped one.

    Raises:
        FileNotFoundError: the recorded tokenizer is not on this machine.
    """
    from torchtitan.checkpointing.files.marker import recorded_tokenizer
    from torchtitan.checkpointing.hf.files import hf_folder_tokenizer

    fix = "pass --tokenizer, the same tokenizer's file or folder"
    recorded = recorded_tokenizer(checkpoint, fix=fix) if checkpoint else None
    return recorded or (hf_folder_tokenizer(hf) if hf else None) or SHIPPED_TOKENIZER


def _full(logits: torch.Tensor) -> torch.Tensor:
    """Plain logits (a DTensor under tensor parallel)."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if bool(args.checkpoint) == bool(args.hf):
        parser.error("give a checkpoint folder or --hf HF_DIR (one of them)")
    if (args.system is not None or args.image) and not args.chat:
        parser.error("--system and --image belong to a chat message; add --chat")
    from torchtitan.distributed.backend.device import get_device_info, init_distributed

    info = get_device_info()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        init_distributed(info, 300, 0)
    try:
        check_speculative(args, None)
        args.tokenizer = args.tokenizer or default_tokenizer(args.hf, args.checkpoint)
        if args.image:
            prompt, model = image_prompt_and_model(args, info.device)
        else:
            prompt = build_prompt(args)
            max_len = len(prompt.ids) + args.max_new_tokens
            model = load_model(args.checkpoint, args.hf, max_len, prompt.n_words, info.device, args.adapter)
        check_speculative(args, model)
    except (ValueError, NotImplementedError, FileNotFoundError, ImportError, jinja2.TemplateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.speculative:
        generated, stats = complete_speculative(model, prompt, args.max_new_tokens, info.device)
    else:
        generated, stats = complete(model, prompt, args, info.device), None
    if int(os.environ.get("RANK", "0")) == 0:
        print(prompt.to_text(generated))
        if stats is not None:
            print(stats.line())
    return 0


def check_speculative(args: argparse.Namespace, model: torch.nn.Module | None) -> None:
    """With ``--speculative``: refuse sampling, ``--no_cache`` and several ranks (before loading), and a model
    without multi-token-prediction depths (``model``, once loaded), each in one line."""
    if not args.speculative:
        return
    from torchtitan.components.generation.speculative import check_speculative_settings, mtp_depths

    if model is not None:
        mtp_depths(model)
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_speculative_settings(
        temperature=args.temperature, top_k=args.top_k, use_cache=not args.no_cache, world_size=world
    )


def complete_speculative(model: torch.nn.Module, prompt: Prompt, max_new_tokens: int, device: torch.device):
    """``complete`` with ``--speculative mtp``: (the ids generated after the prompt, the run's ``SpeculativeStats``)."""
    from torchtitan.components.generation.speculative import generate_speculative

    ids = torch.tensor([prompt.ids], device=device)
    out, stats = generate_speculative(model, ids, max_new_tokens, stop_token=prompt.stop_ids)
    return out[0, len(prompt.ids) :].tolist(), stats


def complete(model: torch.nn.Module, prompt: Prompt, args: argparse.Namespace, device: torch.device) -> list[int]:
    """The ids generated after the prompt (the prompt left out), up to and including the first of
    ``prompt.stop_ids`` when one comes within ``--max_new_tokens``."""
    use_cache = not args.no_cache and KVCache.fits(model)
    if not args.no_cache and not use_cache:
        print(
            "note: this model's layers are transformers' own, not our attention or recurrent layers: generating "
            "without the KV cache (as --no_cache)",
            file=sys.stderr,
        )
    out = generate(
        model,
        torch.tensor([prompt.ids], device=device),
        args.max_new_tokens,
        Sampling(args.temperature, args.top_k),
        use_cache=use_cache,
        stop_token=prompt.stop_ids,
        generator=torch.Generator(device).manual_seed(args.seed),
    )
    return out[0, len(prompt.ids) :].tolist()


if __name__ == "__main__":
    sys.exit(main())
