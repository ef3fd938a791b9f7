"""The harmony demo: word problems in GSM8K's format, a supervised cold start, then GRPO, on the CPU.

    python tools/demo_word_problems.py [--out DIR] [--cold-start-steps N] [OVERRIDES...]

    data        DIR/data: 4000 training problems (train.jsonl), the first 4000 of them also as harmony
                conversations (sft.jsonl: analysis = the two steps, final = the answer), 200 held-out
                problems (test.jsonl, disjoint from training by template and operands)
    cold start  configs/demo_word_problems.yaml with run.mode=sft: supervised on sft.jsonl (DIR/cold_start)
    RL          the same config, run.init_from_hf = the cold start's HF export (DIR/rl); its step-0
                evaluation is the cold start's held-out accuracy (greedy, all 200 problems)
    plot        DIR/both_phases.png: the cold start's metrics, then RL's, on one step axis

OVERRIDES (config fields, e.g. run.steps=50 model.hidden_size=64) apply to both phases; the cold start's
length and learning rate are its own. Prints the held-out accuracy before and after RL and the wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/demo_word_problems.yaml"
COLD_START = ["run.mode=sft", "optim.lr=3.0e-3", "optim.lr_schedule=cosine"]


def train(overrides: list[str]) -> None:
    subprocess.run(
        [sys.executable, "-m", "megatron_gptoss.train", "--config", str(CONFIG), *overrides], check=True
    )


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/demo_word_problems", help="output directory")
    parser.add_argument("--cold-start-steps", type=int, default=25, help="supervised steps (default 25)")
    parser.add_argument("--train", type=int, default=4000, help="training problems (default 4000)")
    args, overrides = parser.parse_known_args(argv)
    out = Path(args.out)
    start = time.perf_counter()
    data = out / "data"
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
    cold_start = out / "cold_start"
    train(
        [
            *files,
            *COLD_START,
            f"run.steps={args.cold_start_steps}",
            f"run.output_dir={cold_start}",
            *overrides,
        ]
    )
    cold_done = time.perf_counter()
    rl = out / "rl"
    train([*files, f"run.init_from_hf={cold_start / 'hf_final'}", f"run.output_dir={rl}", *overrides])
    done = time.perf_counter()
    from megatron_gptoss.utils.metrics import read_metrics
    from megatron_gptoss.utils.plot import plot_metrics

    plot_metrics(rl / "metrics.jsonl", out / "both_phases.png", before=[cold_start / "metrics.jsonl"])
    evals = [
        (r["step"], r["eval/accuracy"]) for r in read_metrics(rl / "metrics.jsonl") if "eval/accuracy" in r
    ]
    summary = {
        "cold_start_accuracy": evals[0][1],
        "rl_accuracy": evals[-1][1],
        "rl_steps": evals[-1][0],
        "cold_start_s": cold_done - start,
        "rl_s": done - cold_done,
        "total_s": time.perf_counter() - start,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
