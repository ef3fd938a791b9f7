"""Where one decode step of the embedded engine spends its GPU time: gpt-oss-20b at full size (random bf16
weights drawn on the device), B rows decoding after prompts of --prompt-len tokens, one step profiled with
torch.profiler with its decode step eager (`cuda_graphs=off`: kernels attributed to their ops) and replayed
from a CUDA graph; prints the kernels by GPU time and the median time of the decode-only steps.

    python benchmarks/profile_decode.py --slots 256
    python benchmarks/profile_decode.py --slots 256 --expert-format mxfp4-pairs --lora-rank 32
                                    # the LoRA RL step's engine: MXFP4 experts (random codes at scale 2^-7)
                                    # and rank-32 adapters on the recipe's targets (bench_rollout's)
    python benchmarks/profile_decode.py --slots 256,512 --expert-format mxfp4-pairs --lora-rank 32 \
        --modes auto                # both slot counts' kernels side by side: what grows with the rows
    python benchmarks/profile_decode.py --tiny            # a toy model (CPU or GPU), a smoke run
    python benchmarks/profile_decode.py --phase prefill --slots 64 --prompt-len 96 --chunk 1536 \
        --expert-format mxfp4-pairs --lora-rank 32 --modes off   # the prompts' prefill steps instead
    python benchmarks/profile_decode.py --phase mixed --slots 256 --prompt-len 100 --decode-steps 24 \
        --expert-format mxfp4-pairs --lora-rank 32 --host   # steps that prefill a prompt beside B - 1 rows
                                    # decoding: a row finishes each step and the next prompt takes its slot
    python benchmarks/profile_decode.py --slots 512 --prompt-len 600 --expert-format mxfp4-pairs \
        --lora-rank 32 --modes auto --window 8 --trace decode.json
                                    # 8 steps as a rollout runs them (no sync between, steps launched
                                    # ahead): the device's idle time per step and its longest gaps
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import math
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from megatron_gptoss.config import EmbeddedEngineConfig, gpt_oss_20b
from megatron_gptoss.engine_api.protocol import SamplingParams
from megatron_gptoss.rollout.embedded import EmbeddedEngine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rollout import FORMATS, int_list, random_adapters, random_weights, with_adapters  # noqa: E402

from megatron_gptoss.model.mxfp4_weight import mxfp4_weights  # noqa: E402


def random_mxfp4(engine: EmbeddedEngine, seed: int = 2) -> None:
    """Every MXFP4 expert weight: random FP4 codes at scale 2^-7 (values about 0.02), drawn on the device."""
    gen = torch.Generator(device=engine.device).manual_seed(seed)
    for weight in mxfp4_weights(engine.model).values():
        shape = weight.blocks.shape
        blocks = torch.randint(0, 256, shape, generator=gen, device=engine.device, dtype=torch.uint8)
        weight.copy_packed_(blocks, torch.full(shape[:-1], 120, dtype=torch.uint8, device=engine.device))
    engine.memory.weights_loaded()


class ProfiledEngine(EmbeddedEngine):
    """Times the steps in which all `rows` rows decode (or, `phase` "prefill", those that prefill prompt
    tokens; "mixed", those that prefill beside decoding rows); profiles the `profile_at`-th of them."""

    rows: int = 0
    profile_at: int = 8
    times: list[float]
    kernels: dict[str, float] | None = None
    ops: str | None = None  # the eager step's op table, where asked for
    want_ops: bool = False
    host: cProfile.Profile | None = None  # host time of the decode-only steps, where asked for

    phase: str = "decode"  # "prefill" / "mixed": the steps that prefill (beside decoding rows) are timed

    window: int = 0  # > 0: that many consecutive decode-only steps profiled as the engine runs them
    idle: str | None = None  # the window's device idle report
    trace: str | None = None  # where the window's Chrome trace goes, where asked for
    _window: tuple | None = None  # (profiler, steps so far) while the window is open
    _last: float | None = None  # when the last decode-only step was called (window mode)

    def _ready(self) -> bool:
        """Whether the next step is one of the timed ones (`phase`)."""
        scheduler = self._scheduler
        running = scheduler.running if scheduler is not None else []
        if self.phase in ("prefill", "mixed"):
            waiting = scheduler is not None and bool(scheduler.waiting)
            prefilling = any(len(s.tokens) - s.computed > 1 for s in running)
            if self.phase == "prefill":  # prompts not yet admitted, or admitted and not yet wholly computed
                ready = waiting or prefilling
            else:  # a prompt admitted now or still prefilling, beside rows that decode
                admits = waiting and len(running) < self.options.max_batch_slots
                ready = (admits or prefilling) and any(len(s.tokens) - s.computed == 1 for s in running)
        else:
            ready = len(running) == self.rows and all(len(s.tokens) - s.computed == 1 for s in running)
        return ready

    def _step(self, ahead: bool = True):
        if self.window:
            return self._window_step(ahead)
        sync(self.device)
        start = time.perf_counter()
        ready = self._ready()
        if ready and len(self.times) == self.profile_at and self.kernels is None:
            cuda = self.device.type == "cuda"
            activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
            if self.want_ops and cuda:  # host ops too: eager steps attribute the kernels to them
                activities.append(ProfilerActivity.CPU)
            with profile(activities=activities) as prof:
                plan = super()._step(ahead)
                sync(self.device)
            self.kernels = kernel_times(prof)
            if self.want_ops:
                key = "self_device_time_total" if cuda else "self_cpu_time_total"
                self.ops = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
        elif ready and self.host is not None:
            self.host.enable()
            plan = super()._step(ahead)
            self.host.disable()
        else:
            plan = super()._step(ahead)
        sync(self.device)
        if ready:
            self.times.append(time.perf_counter() - start)
        return plan

    def _window_step(self, ahead: bool):
        """--window: no sync between steps, so that a step launched ahead overlaps the host's work as in a
        rollout; a decode-only step is timed from its call to the next one's, and `window` of them from the
        `profile_at`-th are profiled together (device kernels and host calls)."""
        ready = self._ready()
        now = time.perf_counter()
        if ready and self._last is not None:
            self.times.append(now - self._last)
        self._last = now if ready else None
        if ready and self._window is None and self.idle is None and len(self.times) == self.profile_at:
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            )
            prof = profile(activities=activities)
            prof.__enter__()
            self._window = (prof, 0)
        plan = super()._step(ahead)
        if self._window is not None:
            prof, steps = self._window[0], self._window[1] + 1
            self._window = (prof, steps)
            if steps == self.window or not ready:
                sync(self.device)
                prof.__exit__(None, None, None)
                self._window = None
                self.kernels = {name: t / steps for name, t in kernel_times(prof).items()}
                self.idle = idle_report(prof, steps)
                if self.trace:
                    prof.export_chrome_trace(self.trace)
        return plan


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_times(prof) -> dict[str, float]:
    """Seconds per kernel name (device time; CPU time without a GPU)."""
    out: dict[str, float] = defaultdict(float)
    for event in prof.events():
        device = getattr(event, "device_type", None)
        if device is not None and "CUDA" not in str(device) and torch.cuda.is_available():
            continue
        micros = getattr(event, "self_device_time_total", None) or getattr(event, "self_cpu_time_total", 0)
        out[event.name] += micros * 1e-6
    return dict(out)


def idle_report(prof, steps: int, top: int = 10, small_us: float = 20.0) -> str:
    """Where the device stood idle over a profiled window of `steps` steps: its span, busy time (the union of
    its kernels and copies) and idle time per step, the idle split into gaps under `small_us` (between the
    kernels of a graph or a launch sequence) and longer ones, and the `top` longest gaps with the host calls
    in flight across each and the kernel that ended it."""
    device, host = [], []
    for event in prof.events():
        span = (event.time_range.start, event.time_range.end, event.name)
        (device if "CUDA" in str(getattr(event, "device_type", "")) else host).append(span)
    if not device:
        return "no device events (CPU run): no idle report"
    device.sort()
    busy, gaps = 0.0, []
    start, end = device[0][0], device[0][1]
    for s, e, name in device[1:]:
        if s > end:
            busy += end - start
            gaps.append((end, s, name))
            start = s
        end = max(end, e)
    busy += end - start
    span = max(e for _, e, _ in device) - device[0][0]
    small = sum(b - a for a, b, _ in gaps if b - a < small_us)
    large = [g for g in gaps if g[1] - g[0] >= small_us]

    def ms(us: float) -> str:  # per step
        return f"{us / steps / 1e3:.2f} ms"

    lines = [
        f"device over {steps} steps (per step): span {ms(span)}, busy {ms(busy)}, idle {ms(span - busy)}: "
        f"{ms(small)} in {len(gaps) - len(large)} gaps under {small_us:.0f} us, "
        f"{ms(sum(b - a for a, b, _ in large))} in {len(large)} longer",
        "| gap us | at ms | host calls in flight across it (us) | kernel after it |",
        "|---|---|---|---|",
    ]
    for a, b, name in sorted(large, key=lambda g: g[0] - g[1])[:top]:
        over = sorted((min(e, b) - max(s, a), n) for s, e, n in host if s < b and e > a)[::-1][:3]
        calls = ", ".join(f"{short(n, 40)} ({t:.0f})" for t, n in over) or "none"
        lines.append(f"| {b - a:.0f} | {(a - device[0][0]) / 1e3:.2f} | {calls} | {short(name, 50)} |")
    return "\n".join(lines)


def short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--slots",
        type=int_list,
        default=[256],
        help="rows decoding at once, comma-separated: with several, the profiled step's kernels side by side "
        "(what grows with the rows)",
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--top", type=int, default=14)
    parser.add_argument("--modes", default="off,auto", help="cuda_graphs modes to profile")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--host", action="store_true", help="also print the host functions by own time")
    ops_help = "also print the profiled step's ops by device time (eager steps attribute kernels to ops)"
    parser.add_argument("--ops", action="store_true", help=ops_help)
    parser.add_argument(
        "--expert-format", default="bf16", choices=sorted(FORMATS), help="how the experts are held"
    )
    parser.add_argument("--lora-rank", type=int, default=0, help="adapters of this rank (0: none)")
    parser.add_argument(
        "--phase", choices=("decode", "prefill", "mixed"), default="decode",
        help="prefill: time the steps that prefill the prompts and profile the second; mixed: those that "
        "prefill a prompt beside decoding rows",
    )  # fmt: skip
    parser.add_argument("--chunk", type=int, default=4096, help="prompt tokens a step prefills, at most")
    parser.add_argument(
        "--window", type=int, default=0,
        help="profile this many consecutive decode-only steps without a sync between them (steps launched "
        "ahead overlap the host's work, as in a rollout): the device's idle time and its longest gaps",
    )  # fmt: skip
    parser.add_argument("--trace", help="with --window: write the window's Chrome trace to this path")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.tiny:
        tiny = dict(vocab_size=512, hidden_size=64, intermediate_size=64, num_layers=2, num_attention_heads=4,
                    num_query_groups=2, head_dim=16, sliding_window=16, num_experts=8, moe_router_topk=2,
                    attention_backend="eager")  # fmt: skip
        config = gpt_oss_20b(**tiny)
        args.slots = [min(slots, 4) for slots in args.slots]
        args.prompt_len, args.decode_steps = min(args.prompt_len, 12), 10
    else:
        config = gpt_oss_20b()
    config = dataclasses.replace(with_adapters(config, args.lora_rank), **FORMATS[args.expert_format])
    engine = ProfiledEngine(config, dtype, device)
    random_weights(engine)
    if config.expert_format == "mxfp4":
        random_mxfp4(engine)
    if config.lora.enabled:
        random_adapters(engine)
    counts = sorted(set(args.slots))
    runs: dict[tuple[int, str], dict[str, float]] = {}
    for slots in counts:
        for mode in args.modes.split(","):
            runs[slots, mode] = profile_run(engine, config, args, slots, mode)
    if len(counts) > 1:
        for mode in args.modes.split(","):
            print_growth(counts, {s: runs[s, mode] for s in counts}, mode, args.top)


def profile_run(
    engine: ProfiledEngine, config, args: argparse.Namespace, slots: int, mode: str
) -> dict[str, float]:
    """Generate with `slots` rows under cuda_graphs=`mode`, print the timed steps and the profiled step's
    kernels (and the asked tables); return its seconds per kernel."""
    chunk = args.chunk
    first = math.ceil(slots * args.prompt_len / chunk)  # steps that prefill the first prompts
    new = args.decode_steps + first
    budgets = [new] * slots
    if args.phase == "mixed":  # row i < k stops after new + i tokens, one of k more prompts takes its slot
        k = min(args.decode_steps, slots)
        budgets = [new + i if i < k else new + k + 1 for i in range(slots)] + [k + 2] * k
    prompts = torch.randint(0, config.vocab_size, (len(budgets), args.prompt_len)).tolist()
    engine.reconfigure(
        EmbeddedEngineConfig(
            max_batch_slots=slots,
            max_step_tokens=slots + chunk,
            kv_blocks=slots * math.ceil((args.prompt_len + max(budgets)) / 16) + 1,
            cuda_graphs=mode,
            admit_batch=1,  # a waiting prompt joins as soon as a slot frees (--phase mixed's steps)
        )
    )
    engine.rows, engine.times, engine.kernels = slots, [], None
    engine.host = cProfile.Profile() if args.host else None
    engine.want_ops, engine.ops = args.ops, None
    engine.phase = args.phase
    engine.window, engine.idle, engine.trace, engine._last = args.window, None, args.trace, None
    # mixed: past the first prompts' chunks that prefill beside rows already decoding
    profile_at = {"prefill": 1, "mixed": first - 1 + min(args.decode_steps, slots) // 2}
    engine.profile_at = profile_at.get(args.phase, min(8, args.decode_steps // 2))
    engine.generate(prompts, SamplingParams(seed=1), max_new_tokens=budgets)
    step = statistics.median(engine.times) if engine.times else float("nan")
    if args.phase == "mixed":
        print(f"\n## cuda_graphs={mode}: {len(engine.times)} steps that prefill beside decoding rows "
              f"({slots} slots, prompts of {args.prompt_len} tokens), median {1e3 * step:.2f} ms, "
              f"in all {sum(engine.times):.3f} s; experts {args.expert_format}, LoRA rank "
              f"{args.lora_rank}")  # fmt: skip
    elif args.phase == "prefill":
        tokens = slots * args.prompt_len
        print(f"\n## cuda_graphs={mode}: {tokens} prompt tokens of {slots} rows, "
              f"{len(engine.times)} prefill steps of up to {chunk} tokens, median {1e3 * step:.2f} ms, "
              f"in all {sum(engine.times):.3f} s; experts {args.expert_format}, LoRA rank "
              f"{args.lora_rank}")  # fmt: skip
    else:
        print(f"\n## cuda_graphs={mode}: {slots} rows, {len(engine.times)} decode-only steps, "
              f"median {1e3 * step:.2f} ms ({slots / step:.0f} tokens/s); experts "
              f"{args.expert_format}, LoRA rank {args.lora_rank}")  # fmt: skip
    kernels = engine.kernels or {}
    total = sum(kernels.values())
    print(f"profiled step: {1e3 * total:.2f} ms of kernel time")
    print("| kernel | ms | share |\n|---|---|---|")
    for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"| {short(name)} | {1e3 * seconds:.3f} | {seconds / max(total, 1e-12):.1%} |")
    if engine.idle is not None:
        print(f"the {args.window} profiled steps launched as in a rollout, no sync between them: "
              f"{engine.idle}")  # fmt: skip
    if engine.ops is not None:
        print(f"ops of the profiled step:\n{engine.ops}")
    if engine.host is not None:
        text = io.StringIO()
        pstats.Stats(engine.host, stream=text).sort_stats("tottime").print_stats(args.top)
        # then the package's own functions by time inside them and what they call
        by_package = pstats.Stats(engine.host, stream=text).sort_stats("cumulative")
        by_package.print_stats("megatron_gptoss", args.top)
        print(f"host functions over {len(engine.times)} steps (the device sync shows as the copy back):")
        print(text.getvalue().split("\n", 4)[-1])
    return kernels


def print_growth(slots: list[int], kernels: dict[int, dict[str, float]], mode: str, top: int) -> None:
    """What grows with the rows: the profiled step's kernels at every slot count (`slots`: distinct, in
    increasing order) side by side, the `top` of the largest count by time first, each with its time at the
    largest count over its time at the smallest and that over the rows' ratio (1.00: the kernel's time grows
    as its rows do; near 0: it stays flat)."""
    low, high = slots[0], slots[-1]
    print(f"\n## cuda_graphs={mode}: the profiled step's kernels at {', '.join(map(str, slots))} slots")
    print(f"| kernel | {' | '.join(f'ms at {s}' for s in slots)} | x {high} / {low} | growth / rows |")
    print(f"|---|{'---|' * len(slots)}---|---|")

    def line(name: str, times: list[float]) -> None:
        ratio = times[-1] / times[0] if times[0] > 0 else float("inf")
        cells = " | ".join(f"{1e3 * t:.3f}" for t in times)
        print(f"| {short(name)} | {cells} | {ratio:.2f} | {(ratio - 1) / (high / low - 1):.2f} |")

    for name in sorted(kernels[high], key=lambda n: -kernels[high][n])[:top]:
        line(name, [kernels[s].get(name, 0.0) for s in slots])
    line("all kernels", [sum(kernels[s].values()) for s in slots])


if __name__ == "__main__":
    main()
