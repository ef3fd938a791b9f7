"""Write the lookup task (`megatron_gptoss.envs.lookup`): DIR/train.jsonl (a question on every training key),
DIR/test.jsonl (every held-out key; never in training) in verl's schema with the value as the ground truth,
and DIR/sft.jsonl: cold-start harmony conversations, at most 5% of them calling the lookup tool.

    python tools/make_lookup_task.py --sft 2000 --out data/lookup
    python -m megatron_gptoss.train --config configs/demo_lookup.yaml \
        data.train_files=[data/lookup/train.jsonl] data.eval_files=[data/lookup/test.jsonl]
"""

from __future__ import annotations

import argparse

from megatron_gptoss.envs.lookup import MAX_LOOKUP_FRACTION, write_files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft", type=int, default=2000, help="cold-start conversations (default 2000)")
    parser.add_argument(
        "--lookup-fraction",
        type=float,
        default=MAX_LOOKUP_FRACTION,
        help=f"share of the conversations calling lookup (at most {MAX_LOOKUP_FRACTION}, the default)",
    )
    parser.add_argument(
        "--arithmetic-fraction",
        type=float,
        default=0.8,
        help="share of the conversations calling the calculator (default 0.8)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the rows' order and the conversations")
    parser.add_argument("--out", required=True, help="directory to write the three files into")
    args = parser.parse_args(argv)
    paths = write_files(args.out, args.sft, args.seed, args.lookup_fraction, args.arithmetic_fraction)
    for path in paths:
        print(f"{path}: {sum(1 for _ in path.open())} rows")


if __name__ == "__main__":
    main()
