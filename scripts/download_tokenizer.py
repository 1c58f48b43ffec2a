"""Download a model's tokenizer from the Hugging Face hub: Llama 3's (tiktoken), or Qwen3's, DeepSeek's or
gpt-oss's (tokenizer.json).

Two layouts, chosen by the repo's owner unless --tokenizer_path/--files/--local_dir say otherwise:
  meta-llama/* (and any other repo): original/tokenizer.model, saved to
      torchtitan/datasets/tokenizer/original/tokenizer.model
  Qwen/*, deepseek-ai/*, openai/*: tokenizer.json and tokenizer_config.json (which names the end-of-text
      token) from the repo root, saved to torchtitan/datasets/tokenizer/<repo name>/ (the folder is the
      tokenizer_path)

The Llama repos are gated: accept the license on the model page, then create a read token at
https://huggingface.co/settings/tokens. Needs network; offline runs can use the shipped default
tokenizer `torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken` instead.

Usage:
    python scripts/download_tokenizer.py --repo_id meta-llama/Meta-Llama-3.1-8B --hf_token <token>
    python scripts/download_tokenizer.py --repo_id Qwen/Qwen3-8B
    python scripts/download_tokenizer.py --repo_id openai/gpt-oss-20b
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_ROOT = "torchtitan/datasets/tokenizer"
TIKTOKEN_FILES = ("tokenizer.model",)
HF_FILES = ("tokenizer.json", "tokenizer_config.json")
# hub owners whose repos ship a Hugging Face tokenizer.json at the root and no tiktoken file
HF_TOKENIZER_OWNERS = ("qwen", "deepseek-ai", "openai")


@dataclass(frozen=True)
class Layout:
    """Where the tokenizer lives in the repo and where it is saved."""

    tokenizer_path: str  # folder inside the repo; "" = its root
    files: tuple[str, ...]
    local_dir: str  # hf_hub_download keeps the repo's folders below it


def resolve_layout(
    repo_id: str, tokenizer_path: str | None = None, files: list[str] | None = None, local_dir: str | None = None
) -> Layout:
    """The repo owner's default layout, with any given argument taking its place."""
    if repo_id.split("/")[0].lower() in HF_TOKENIZER_OWNERS:
        default = Layout("", HF_FILES, f"{TOKENIZER_ROOT}/{repo_id.split('/')[-1]}")
    else:
        default = Layout("original", TIKTOKEN_FILES, f"{TOKENIZER_ROOT}/")
    return Layout(
        default.tokenizer_path if tokenizer_path is None else tokenizer_path,
        default.files if files is None else tuple(files),
        default.local_dir if local_dir is None else local_dir,
    )


def download_tokenizer(repo_id: str, layout: Layout, hf_token: str | None) -> list[Path]:
    """Fetch each of `layout.files` under `layout.tokenizer_path` of `repo_id`; returns the saved paths.

    Raises:
        ValueError: the repo is gated/unknown, a file is missing, or the hub is unreachable.
    """
    # imported here so `--help` works without huggingface_hub installed
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    folder = layout.tokenizer_path.strip("/")
    paths = []
    for name in layout.files:
        filename = f"{folder}/{name}" if folder else name
        try:
            path = hf_hub_download(repo_id=repo_id, filename=filename, local_dir=layout.local_dir, token=hf_token)
        except GatedRepoError as e:
            raise ValueError(
                f"{repo_id} is gated and the token was refused; accept the license at "
                f"https://huggingface.co/{repo_id} and pass a read token with --hf_token"
            ) from e
        except RepositoryNotFoundError as e:
            raise ValueError(f"repo {repo_id!r} not found (or private without --hf_token); check --repo_id") from e
        # LocalEntryNotFoundError subclasses EntryNotFoundError: catch the no-network case first
        except LocalEntryNotFoundError as e:
            raise ValueError(
                f"cannot reach the Hugging Face hub to fetch {repo_id}/{filename} (no network?); "
                f"use the shipped tokenizer torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken offline"
            ) from e
        except EntryNotFoundError as e:
            raise ValueError(
                f"{repo_id} has no file {filename!r}; check --tokenizer_path and --files (Llama 3: 'original' and "
                "tokenizer.model; Qwen3: the root ('') and tokenizer.json tokenizer_config.json)"
            ) from e
        except HfHubHTTPError as e:
            raise ValueError(f"hub request for {repo_id}/{filename} failed: {e}; check --hf_token and network") from e
        paths.append(Path(path))
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo_id", default="meta-llama/Meta-Llama-3.1-8B", help="hub repo holding the tokenizer")
    parser.add_argument(
        "--tokenizer_path",
        default=None,
        help="folder of the files inside the repo, '' for its root (default: 'original'; Qwen/*: the root)",
    )
    parser.add_argument(
        "--files",
        nargs="+",
        default=None,
        help="file names to fetch (default: tokenizer.model; Qwen/*: tokenizer.json tokenizer_config.json)",
    )
    parser.add_argument("--hf_token", default=None, help="Hugging Face read token (the Llama repos are gated)")
    parser.add_argument(
        "--local_dir",
        default=None,
        help=f"where to save them, below which the repo's folders are kept (default: {TOKENIZER_ROOT}/; "
        f"Qwen/*: {TOKENIZER_ROOT}/<repo name>)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    layout = resolve_layout(args.repo_id, args.tokenizer_path, args.files, args.local_dir)
    paths = download_tokenizer(args.repo_id, layout, args.hf_token)
    for path in paths:
        logger.info("saved %s", path)
    # a Hugging Face tokenizer is read from its folder (tokenizer.json + tokenizer_config.json)
    hf = any(p.name == "tokenizer.json" for p in paths)
    logger.info("set the training config's model.tokenizer_path to %s", paths[0].parent if hf else paths[0])


if __name__ == "__main__":
    main()
