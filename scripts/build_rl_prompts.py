"""Write tests/assets/rl/arith_prompts.jsonl: the RL prompts of the shipped arithmetic task.

Every ordered pair (A, B), 0 <= A, B <= 19, that the fine-tuning task holds out of training
((A*A + B*B) % 11 != 1; tests/assets/sft/README.md) is one chat row, phrased and prefixed with a system message
as the fine-tuning rows are, with the expected ``answer`` ("A plus B is C.", or "C" under "Answer with the number
only.") for the shipped rewards. So RL never sees a held-out question: bench/rl_arith.py scores those.

    python scripts/build_rl_prompts.py [--output tests/assets/rl/arith_prompts.jsonl] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random

FORMS = (
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "How much is {a} plus {b}?",
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
)
NUMBER_ONLY = "Answer with the number only."


def rows(seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for a in range(20):
        for b in range(20):
            if (a * a + b * b) % 11 == 1:
                continue  # held out of fine-tuning and RL alike
            form = FORMS[0] if rng.random() < 0.5 else rng.choice(FORMS)
            system = rng.choices([None, NUMBER_ONLY, "Be helpful."], weights=[0.75, 0.15, 0.10])[0]
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": form.format(a=a, b=b)}
            ]
            answer = str(a + b) if system == NUMBER_ONLY else f"{a} plus {b} is {a + b}."
            out.append({"messages": messages, "answer": answer})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="tests/assets/rl/arith_prompts.jsonl")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with open(args.output, "w", encoding="utf-8") as f:
        for row in rows(args.seed):
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
