"""How the command-line tools end on the project's errors: one line naming the error class and its
message on standard error, exit status 1, no traceback, as `megatron_gptoss.train` ends. Any other
exception is a bug and keeps its traceback.

    if __name__ == "__main__":
        with one_line_errors():
            main()
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_gptoss.errors import MegatronGptossError


@contextmanager
def one_line_errors(program: str | None = None) -> Iterator[None]:
    """Turn a MegatronGptossError raised in the block into `PROGRAM: ErrorClass: message` (one line, the
    message's line breaks made spaces) on standard error and SystemExit(1). `program` defaults to the name
    of the running script."""
    try:
        yield
    except MegatronGptossError as error:
        name = program or Path(sys.argv[0]).name
        message = " ".join(str(error).splitlines())
        print(f"{name}: {type(error).__name__}: {message}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
