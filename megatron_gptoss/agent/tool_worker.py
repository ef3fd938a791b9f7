"""A worker process that runs user function tools (`agent.tools`) for `tools.ToolWorkers`. It imports only
the standard library and is run by path (`python -I tool_worker.py`), so it starts in tens of milliseconds
and never holds CUDA or the trainer's state; the user's modules are imported once, when it starts.

Protocol, one JSON object per line, requests on its standard input, answers on the descriptor that was its
standard output (the functions' own prints go to standard error):

    -> {"path": [the trainer's sys.path], "functions": ["module:function", ...], "parent": pid}
    <- {"ready": true}, or {"ready": false, "error": "..."} when a function cannot be imported here
    -> {"function": "module:function", "arguments": {...}}
    <- {"text": "..."} (the function's string, or its JSON-serialisable value as JSON)
       or {"error": "Type: message"} (whatever the function raised, SystemExit included)

It exits at the end of its input, and within a second of the trainer's end (a function holding the GIL
delays that until it returns: the trainer kills a worker whose call passed its timeout).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
import time
from typing import Any


def _resolve(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _exit_with(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _answer(out: Any, message: dict) -> None:
    out.write(json.dumps(message).encode() + b"\n")
    out.flush()


def _run(functions: dict[str, Any], request: dict) -> dict:
    try:
        value = functions[request["function"]](**request["arguments"])
        return {"text": value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)}
    except BaseException as err:  # noqa: BLE001 (whatever a user function raises is its call's answer)
        return {"error": f"{type(err).__name__}: {err}"}


def main() -> None:
    requests, out = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a function reading stdin reads nothing
    os.dup2(2, 1)  # its prints go to standard error, never into the answers
    line = requests.readline()
    if not line:
        return
    init = json.loads(line)
    threading.Thread(target=_exit_with, args=(init["parent"],), daemon=True).start()
    sys.path[:] = init["path"]
    functions = {}
    for spec in init["functions"]:
        try:
            functions[spec] = _resolve(spec)
        except BaseException as err:  # noqa: BLE001 (reported to the trainer, which stops)
            _answer(out, {"ready": False, "error": f"{spec}: {type(err).__name__}: {err}"})
            return
    _answer(out, {"ready": True})
    for line in requests:
        _answer(out, _run(functions, json.loads(line)))


if __name__ == "__main__":
    main()
