"""The harmony demo: word problems in GSM8K's format, a supervised cold start, then GRPO, on the CPU.

    python tools/demo_word_problems.py [--cold-start-steps N] [--train N] [OVERRIDES...]

    data        OUT/data: 4000 training problems (train.jsonl), the first 4000 of them also as harmony
                conversations (sft.jsonl: analysis = the two steps, final = the answer), 200 held-out
                problems (test.jsonl, disjoint from training by template and operands)
    cold start  configs/demo_word_problems.yaml with run.mode=sft: supervised on sft.jsonl (OUT/cold_start)
    RL          the same config, run.init_from_hf = the cold start's HF export (OUT/rl); its step-0
                evaluation is the cold start's held-out accuracy (greedy, all 200 problems)
    plot        OUT/both_phases.png: the cold start's metrics, then RL's, on one step axis

OVERRIDES (config fields, e.g. run.steps=50 model.hidden_size=64) apply to both phases, except that the cold
start's mode, length and learning rate are its own; run.output_dir=OUT (default outputs/demo_word_problems)
names the output directory. The last line printed is the summary (megatron_gptoss.two_phase): the held-out
accuracy where RL started ("start") and after RL ("final"), and the wall times.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from megatron_gptoss import two_phase

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo_word_problems.yaml"
COLD_START = ["run.mode=sft", "optim.lr=3.0e-3", "optim.lr_schedule=cosine"]


def main(argv: list[str] | None = None) -> dict:
    parser = two_phase.make_parser(__doc__, cold_start_steps=25)
    parser.add_argument("--train", type=int, default=4000, help="training problems (default 4000)")
    args, overrides = two_phase.parse(parser, argv, "outputs/demo_word_problems")
    demo = two_phase.TwoPhase(CONFIG, args.out, overrides)
    data = args.out / "data"
    subprocess.run(
        [sys.executable, str(ROOT / "tools/make_word_problems.py"), "--train", str(args.train),
         "--test", "200", "--sft", str(args.train), "--out", str(data)],
        check=True,
    )  # fmt: skip
    files = [
        f"data.train_files=[{data / 'train.jsonl'}]",
        f"data.eval_files=[{data / 'test.jsonl'}]",
        f"sft.train_files=[{data / 'sft.jsonl'}]",
    ]
    demo.cold_start(args.cold_start_steps, COLD_START, files)
    demo.rl(data=files)
    return demo.finish()


if __name__ == "__main__":
    main()
