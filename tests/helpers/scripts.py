"""The repository's command-line scripts (tools/, benchmarks/) imported as modules by the tests, and the
tensors of an HF directory's safetensors files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def load_script(name: str, folder: str = "tools") -> ModuleType:
    """`folder/name.py` of the repository as the module `name` (registered in sys.modules, so the
    dataclasses it defines find their module)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    assert spec is not None and spec.loader is not None, (folder, name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the `*.safetensors` files in directory `path`."""
    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out
