"""Train: the one program for every world size and launcher.

    python -m megatron_gptoss.train --config configs/demo_cpu.yaml [section.field=value ...]
    torchrun --nproc_per_node 4 -m megatron_gptoss.train --config configs/layouts/tiny_rl_tp2_pp2_cpu.yaml
    ... --resume auto          continue from the newest complete checkpoint of the run
    ... --stop-file PATH       checkpoint and exit 0 once PATH exists (as on SIGTERM / SIGUSR1 / Ctrl-C)

The last line printed is JSON: {"final": metrics, "status": "finished" | "stopped", "step": the last step
run, "output_dir": ...}; "stopped" after a graceful stop (continue with --resume auto). A second Ctrl-C
stops at once (exit 130); a known failure is one line and exit 1.

`run.mode` picks RL (default) or supervised training (`run.mode=sft`). A plain process is a world of one
rank; under torchrun (or srun) every rank runs this same program.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from megatron_gptoss.checkpoint.manager import WRITE_ERRNOS, describe_os_error
from megatron_gptoss.config import load_config
from megatron_gptoss.errors import MegatronGptossError
from megatron_gptoss.trainer.loop import run

log = logging.getLogger("megatron_gptoss.train")

__all__ = ["main", "run"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=str, default=None, help="YAML file of overrides (configs/)")
    parser.add_argument(
        "--resume", default=None, help='"auto" (newest complete checkpoint), a checkpoint directory or ""'
    )
    parser.add_argument(
        "--stop-file", default=None, help="checkpoint and exit 0 once this file exists (run.stop_file)"
    )
    parser.add_argument("overrides", nargs="*", help="section.field=value pairs applied after the file")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"run.resume={args.resume!r}")
    if args.stop_file is not None:
        overrides.append(f"run.stop_file={args.stop_file!r}")
    cfg = None
    try:
        cfg = load_config(args.config, overrides)
        result = run(cfg)
    except MegatronGptossError as error:  # a known failure: one line naming it, no traceback
        log.error("%s: %s", type(error).__name__, error)
        raise SystemExit(1) from None
    except OSError as error:  # a full disk, a file size limit, a directory it may not write
        if error.errno not in WRITE_ERRNOS:
            raise
        log.error("OSError: %s", describe_os_error(error, cfg.run.output_dir if cfg else None))
        raise SystemExit(1) from None
    except KeyboardInterrupt:  # before the first step, or a second Ctrl-C: nothing more is saved
        log.error("interrupted: stopped at once; nothing was saved after the last checkpoint")
        raise SystemExit(130) from None
    if int(os.environ.get("RANK", 0)) == 0:  # the group is gone by now: the launcher's rank
        log.info("final (%s after step %d): %s", result.status, result.step, json.dumps(result))
        line = {"final": result, "status": result.status, "step": result.step}
        print(json.dumps({**line, "output_dir": cfg.run.output_dir}), flush=True)


if __name__ == "__main__":
    main()
