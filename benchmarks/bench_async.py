"""Asynchronous RL against the synchronous loop on the same GPUs: trained tokens per second, steps per hour,
idle fractions and staleness, one trainer run (torchrun) per setting, in one command.

    python benchmarks/bench_async.py                                  # 2 GPUs, word problems, 20b width
    python benchmarks/bench_async.py --settings sync,separate-k1 --layers 6 --steps 8
    python benchmarks/bench_async.py --lookup --init outputs/demo_lookup/cold_start/hf_final
                                     # the lookup task: time to held-out reward 0.9, sync against async
    python benchmarks/bench_async.py --tiny                           # toy model, 2 gloo ranks on the CPU

Throughput workload: GSM8K-format two-step word problems (`tools/make_word_problems.py`) in harmony, the
gpt-oss-20b LoRA recipe (`configs/gpt_oss_20b_lora_1gpu.yaml`, the MXFP4 base) cut to `--layers` layers,
random weights drawn on the device, `--prompts` prompts x 8 samples a step, responses with log-normal budgets
(`rollout.length_median` 256, sigma 1, up to `--max-response` 2,048 tokens: random weights never sample a
stop token, so the budgets give the batch the long tail of a trained model's responses).

Settings (`SETTINGS`, each the same config plus its overrides):
    sync               colocated, max_staleness 0: every rank a learner shard and an engine replica, taking
                       turns; the baseline
    colocated-k1       colocated, max_staleness 1, partial rollouts (rows in flight go on under new weights)
    separate-k1        the last rank an engine only, the others the learner only; max_staleness 1, partial
    separate-k1-whole  the same without partial rollouts (agentic: each batch's trajectories end before the
                       weight sync; with partial they run across it, a tool call in flight included)

Per setting, over the steps between the first (compilation and graph capture) and the last (an
asynchronous setting's last step trains rows generated during the step before and waits for no new ones: a
drain, not the steady state; with it, 4 steps on two H200s overstated separate-k1 at 1.70x sync where the
steps between gave 1.22x): trained tokens per second (the loss tokens, `mismatch/tokens`, over the steps'
wall time `time/step_s`), steps per hour, the idle fractions of the engines and the learner (`idle/*`), the
largest staleness and the rows dropped for it, the mean generate and sync seconds (the sync is where a
learner waits for engines that do not take new weights while they generate); and the ratio of
each throughput to the synchronous one's (else the first setting's). Results accumulate in OUT/results.json,
so that settings run in separate calls on one machine (`--settings sync`, then `--settings separate-k1`, the
same --out) print in one table. `--lookup`: RL on the lookup task (`configs/demo_lookup.yaml` with
its tools, from the cold start's HF export `--init`, learning rate `LOOKUP_LR`, held-out evaluation every 2
steps) per setting; the steps' cumulative time at the first held-out reward >= 0.9, and a plot of the
held-out reward against that time for every setting (OUT/lookup_reward_time.png); with `--slow-tool` every
lookup call takes 0.5-2 s (`envs.lookup.slow_lookup`), every row's call at once in every setting. The
trajectories are agentic either way: whole (separate-k1-whole) they hide only the learner's time behind the
trajectories'; partial (separate-k1) each batch's trajectories run across the weight sync, so two batches
wait on their tools at once. --lookup also prints the throughput table of its runs (8 steps or more give a
steady one). Each run's metrics: OUT/<setting>/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml

from megatron_gptoss.envs.word_problems import write_splits

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/gpt_oss_20b_lora_1gpu.yaml"
LOOKUP_CONFIG = ROOT / "configs/demo_lookup.yaml"
SEPARATE = ["rollout.placement=separate", "rollout.sleep_level=0", "rollout.max_staleness=1"]
SETTINGS = {
    "sync": ["rollout.placement=colocated", "rollout.max_staleness=0"],
    "colocated-k1": ["rollout.placement=colocated", "rollout.max_staleness=1", "rollout.partial=true"],
    "separate-k1": [*SEPARATE, "rollout.partial=true"],
    "separate-k1-whole": SEPARATE,
}
TINY = ["model.preset=gpt_oss_demo", "model.vocab_size=201088", "model.make_vocab_size_divisible_by=128",
        "model.hidden_size=64", "model.intermediate_size=64", "model.num_layers=2", "model.lora.rank=4",
        "rollout.dtype=float32", "run.dtype=float32", "rollout.n_samples_per_prompt=2",
        "ppo.num_micro_batches=1", "ppo.num_mini_batches=1", "embedded.max_batch_slots=8"]  # fmt: skip
THRESHOLD = 0.9  # --lookup: the held-out reward whose first step is timed
LOOKUP_LR = 2.0e-4  # --lookup's learning rate (the demo's 5e-4 learns within the first evaluation)
TOOL_CONCURRENCY = 128  # --slow-tool: tool calls at once, every row's of two batches of the demo's 8 x 8


def run(setting: str, config: Path, overrides: list[str], out: Path, nproc: int) -> list[dict]:
    """One trainer run of `config` under `setting` on `nproc` processes; its metrics records of the steps."""
    run_dir = out / setting
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    command = [*launch, "-m", "megatron_gptoss.train", "--config", str(config), *overrides,
               *SETTINGS[setting], f"run.output_dir={run_dir}", "run.overwrite=true", "run.save_every=0",
               "run.export_hf=false", "run.tensorboard=false"]  # fmt: skip
    subprocess.run(command, check=True)
    text = (run_dir / "metrics.jsonl").read_text()
    lines = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [line for line in lines if "time/step_s" in line or "eval/accuracy" in line]


def throughput(steps: list[dict]) -> dict[str, float]:
    """The setting's figures over its steps between the first and the last (module doc)."""
    last = max((s["step"] for s in steps if "time/step_s" in s), default=0)
    timed = [s for s in steps if "time/step_s" in s and 1 < s["step"] < last]
    if not timed:
        raise ValueError("no step between the first and the last to time: run at least 3 steps (--steps)")
    seconds = sum(s["time/step_s"] for s in timed)
    tokens = sum(s["mismatch/tokens"] for s in timed)

    def mean(key: str) -> float:
        values = [s[key] for s in timed if key in s]
        return sum(values) / len(values) if values else float("nan")

    return {
        "steps": len(timed),
        "tokens_per_s": tokens / seconds,
        "steps_per_hour": 3600 * len(timed) / seconds,
        "step_s": seconds / len(timed),
        "idle_engine": mean("idle/engine_frac"),
        "idle_learner": mean("idle/learner_frac"),
        "staleness_max": max((s.get("staleness/max", 0.0) for s in timed), default=0.0),
        "dropped_rows": sum(s.get("staleness/dropped_rows", 0.0) for s in timed),
        "response_len": mean("response/length_mean"),
        "generate_s": mean("time/generate_s"),
        "sync_s": mean("time/sync_s"),
    }


def print_throughput(results: dict[str, dict[str, float]]) -> None:
    base = next(iter(results.values()))["tokens_per_s"]
    header = ["setting", "steps timed", "step s", "trained tok/s", "steps/h", "idle engine", "idle learner",
              "staleness max", "dropped rows", "response len", "generate s", "sync s",
              "tok/s / first"]  # fmt: skip
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, r in results.items():
        cells = [name, str(r["steps"]), f"{r['step_s']:.2f}", f"{r['tokens_per_s']:,.0f}",
                 f"{r['steps_per_hour']:.1f}", f"{r['idle_engine']:.2f}", f"{r['idle_learner']:.2f}",
                 f"{r['staleness_max']:.0f}", f"{r['dropped_rows']:.0f}", f"{r['response_len']:.0f}",
                 f"{r.get('generate_s', float('nan')):.2f}", f"{r.get('sync_s', float('nan')):.2f}",
                 f"{r['tokens_per_s'] / base:.2f}"]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def reward_against_time(steps: list[dict]) -> list[tuple[float, float]]:
    """(cumulative step seconds, held-out reward) at each evaluation, step 0's at 0 s."""
    elapsed, points = 0.0, []
    for record in steps:
        elapsed += record.get("time/step_s", 0.0)
        if "eval/accuracy" in record:
            points.append((elapsed, record["eval/accuracy"]))
    return points


def time_to(points: list[tuple[float, float]], threshold: float) -> float | None:
    return next((t for t, reward in points if reward >= threshold), None)


def plot_lookup(curves: dict[str, list[tuple[float, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, points in curves.items():
        ax.plot([t for t, _ in points], [r for _, r in points], marker="o", label=name)
    ax.axhline(THRESHOLD, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training seconds (sum of time/step_s)")
    ax.set_ylabel("held-out reward (eval/accuracy)")
    ax.set_title("lookup task: synchronous against asynchronous RL")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", help="comma-separated names of SETTINGS (default: all; --lookup: "
                        "sync,separate-k1,separate-k1-whole)")  # fmt: skip
    parser.add_argument("--nproc", type=int, default=2, help="processes (GPUs), the same for every setting")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4, help="layers of the gpt-oss-20b-width model")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a step (8 samples each)")
    parser.add_argument("--max-response", type=int, default=2048)
    parser.add_argument("--lookup", action="store_true", help="the lookup task's time to reward 0.9")
    parser.add_argument("--init", type=Path, help="--lookup: the cold start's HF export")
    parser.add_argument("--slow-tool", action="store_true", help="--lookup: each tool call takes 0.5-2 s "
                        "(agentic trajectories with a tool as slow as a sandboxed python call)")  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="toy model and batch (a CPU smoke run)")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_async"))
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o]
    if bad:
        parser.error(f"unknown arguments {bad}: overrides are key=value")
    default = "sync,separate-k1,separate-k1-whole" if args.lookup else ",".join(SETTINGS)
    names = (args.settings or default).split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"unknown settings {unknown}: choose from {list(SETTINGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.lookup:
        return lookup(args, names, overrides)
    data = args.out / "data"
    write_splits(data, train=max(512, args.prompts * args.steps), test=1)
    common = [
        f"model.num_layers={args.layers}", f"rollout.prompts_per_step={args.prompts}",
        f"rollout.max_new_tokens={args.max_response}", "rollout.length_median=256",
        "rollout.length_sigma=1.0",
        f"data.train_files=[{data / 'train.jsonl'}]", "data.eval_files=[]", f"run.steps={args.steps}",
        "run.eval_every=0", "run.progress=false", "rollout.sleep_level=0",
        *(TINY + ["rollout.max_new_tokens=24", "rollout.length_median=6"] if args.tiny else []), *overrides,
    ]  # fmt: skip
    saved = args.out / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    for name in names:
        results[name] = throughput(run(name, CONFIG, common, args.out, args.nproc))
        saved.write_text(json.dumps(results, indent=1) + "\n")
    if "sync" in results:  # the baseline's row first: the ratios are to it
        results = {"sync": results.pop("sync"), **results}
    model = "toy model" if args.tiny else f"{args.layers} layers at gpt-oss-20b width, LoRA, MXFP4 base"
    print(f"## asynchronous RL: {args.nproc} processes, {args.prompts} prompts a step, {model}")
    print_throughput(results)
    return results


def slow_tool_config(out: Path) -> Path:
    """The lookup config with its tool answering after 0.5-2 s a call (`envs.lookup.slow_lookup`), written
    to OUT/lookup_slow_tool.yaml."""
    config = yaml.safe_load(LOOKUP_CONFIG.read_text())
    tools = config["agent"]["tools"]
    for tool in tools:
        if tool["name"] == "lookup":
            tool["function"] = "megatron_gptoss.envs.lookup:slow_lookup"
    path = out / "lookup_slow_tool.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def lookup(args, names: list[str], overrides: list[str]) -> dict[str, dict]:
    """--lookup: RL of the lookup task from `--init` under each setting (module doc)."""
    if args.init is None:
        raise SystemExit("--lookup needs --init: the cold start's HF export (tools/demo_lookup.py writes it "
                         "to OUT/cold_start/hf_final)")  # fmt: skip
    data = args.out / "data"
    subprocess.run([sys.executable, str(ROOT / "tools/make_lookup_task.py"), "--out", str(data)], check=True)
    common = [
        f"data.train_files=[{data / 'train.jsonl'}]", f"data.eval_files=[{data / 'test.jsonl'}]",
        "agent.enabled=true", f"run.init_from_hf={args.init}", f"run.steps={args.steps}", "run.eval_every=2",
        # at the demo's 5e-4 a GPU run's held-out reward is 1.0 at the first evaluation (step 2) in every
        # setting, so the time to 0.9 measures step 1 (its compilation); at 2e-4 it takes 4 steps
        f"optim.lr={LOOKUP_LR}",
        # every row's tool call at once in every setting (a tool executor per engine replica colocated, one
        # on learner rank 0 under separate: at the default 8 calls each, separate had half the concurrency)
        *([f"agent.max_concurrent_calls={TOOL_CONCURRENCY}"] if args.slow_tool else []),
        *overrides,
    ]  # fmt: skip
    config = slow_tool_config(args.out) if args.slow_tool else LOOKUP_CONFIG
    curves, results = {}, {}
    for name in names:
        steps = run(name, config, common, args.out, args.nproc)
        points = curves[name] = reward_against_time(steps)
        timed = sum("time/step_s" in s for s in steps) >= 3  # a step between the first and the last
        results[name] = {"time_to_threshold_s": time_to(points, THRESHOLD), "final_reward": points[-1][1],
                         "curve": points, "throughput": throughput(steps) if timed else None}  # fmt: skip
    plot_lookup(curves, args.out / "lookup_reward_time.png")
    base = results[names[0]]["time_to_threshold_s"]
    print(
        f"## lookup task, {args.nproc} processes: training seconds to the first held-out reward "
        f">= {THRESHOLD}"
    )
    print("| setting | seconds to reward >= 0.9 | final reward | / first |")
    print("|---|---|---|---|")
    for name, r in results.items():
        t = r["time_to_threshold_s"]
        ratio = f"{t / base:.2f}" if t is not None and base else "-"
        cells = [name, "not reached" if t is None else f"{t:.1f}", f"{r['final_reward']:.3f}", ratio]
        print("| " + " | ".join(cells) + " |")
    if all(r["throughput"] for r in results.values()):
        print(f"## lookup task: trained tokens per second{' (tool calls 0.5-2 s)' if args.slow_tool else ''}")
        print_throughput({name: r["throughput"] for name, r in results.items()})
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
