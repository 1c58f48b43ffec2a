"""Download Meta's Llama 3 tokenizer (tiktoken format) from the Hugging Face hub.

The Llama repos are gated: accept the license on the model page, then create a read token at
https://huggingface.co/settings/tokens. Needs network; offline runs can use the shipped default
tokenizer `torchtitan/datasets/assets/tokenizer/pydocs_bpe2048.tiktoken` instead.

Usage:
    python scripts/download_tokenizer.py --repo_id meta-llama/Meta-Llama-3.1-8B --hf_token <token>
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

TOKENIZER_FILENAME = "tokenizer.model"


def download_tokenizer(repo_id: str, tokenizer_path: str, hf_token: str | None, local_dir: str) -> Path:
    """Fetch `<tokenizer_path>/tokenizer.model` of `repo_id` into `local_dir`; returns the file's path.

    Raises:
        ValueError: the repo is gated/unknown, the file is missing, or the hub is unreachable.
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

    filename = f"{tokenizer_path.strip('/')}/{TOKENIZER_FILENAME}" if tokenizer_path else TOKENIZER_FILENAME
    try:
        path = hf_hub_download(repo_id=repo_id, filename=filename, local_dir=local_dir, token=hf_token)
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
        raise ValueError(f"{repo_id} has no file {filename!r}; check --tokenizer_path (Llama 3: 'original')") from e
    except HfHubHTTPError as e:
        raise ValueError(f"hub request for {repo_id}/{filename} failed: {e}; check --hf_token and network") from e
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo_id", default="meta-llama/Meta-Llama-3.1-8B", help="hub repo holding the tokenizer")
    parser.add_argument("--tokenizer_path", default="original", help="folder of tokenizer.model inside the repo")
    parser.add_argument("--hf_token", default=None, help="Hugging Face read token (the Llama repos are gated)")
    parser.add_argument("--local_dir", default="torchtitan/datasets/tokenizer/", help="where to save it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path = download_tokenizer(args.repo_id, args.tokenizer_path, args.hf_token, args.local_dir)
    logger.info("saved %s; set the training config's tokenizer_path to it", path)


if __name__ == "__main__":
    main()
