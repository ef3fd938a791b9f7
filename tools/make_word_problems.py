"""Write two-step grade-school word problems in GSM8K's format (`megatron_gptoss.envs.word_problems`):
DIR/train.jsonl and DIR/test.jsonl (held-out problems, never in any training split), for the dataset task,
and with --sft N DIR/sft.jsonl: the first N training problems as harmony conversations for a cold start.

    python tools/make_word_problems.py --train 2000 --test 200 --seed 0 --out data/word_problems
    python -m megatron_gptoss.train --config ... env.name=dataset reward.name=gsm8k \
        data.train_files=[data/word_problems/train.jsonl] data.eval_files=[data/word_problems/test.jsonl]
"""

from __future__ import annotations

import argparse

from megatron_gptoss.envs.word_problems import DEFAULT_HELD_OUT, write_splits


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=2000, help="training problems (default 2000)")
    parser.add_argument(
        "--test", type=int, default=DEFAULT_HELD_OUT, help=f"held-out problems (default {DEFAULT_HELD_OUT})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the draw (not of the split)")
    parser.add_argument(
        "--sft",
        type=int,
        default=0,
        help="training problems also written as harmony conversations (default 0)",
    )
    parser.add_argument("--out", required=True, help="directory to write train.jsonl and test.jsonl into")
    args = parser.parse_args(argv)
    paths = write_splits(args.out, args.train, args.test, args.seed, args.sft)
    for path, count in zip(paths, (args.train, args.test, args.sft)):
        print(f"{path}: {count} problems")


if __name__ == "__main__":
    main()
