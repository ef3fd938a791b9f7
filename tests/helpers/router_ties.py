"""Near-tied routers for the router-replay tests: experts 1 and 2 of every router made equal, the tie broken
by DELTA, so a model and its twin preferring the other expert route some tokens differently."""

from __future__ import annotations

import torch

from megatron_gptoss.model import GPTOSSModel

DELTA = 3e-7  # the bias that breaks the tie: a few float32 ulps of the router's logits


@torch.no_grad()
def tied(model: GPTOSSModel, prefer: int) -> GPTOSSModel:
    """Experts 1 and 2 of every router: equal rows, equal biases, then `prefer` (1 or 2) gets +DELTA."""
    for layer in model.decoder.layers.values():
        router = layer.mlp.router
        router.weight[2] = router.weight[1]
        router.bias[2] = router.bias[1]
        router.bias[prefer] += DELTA
    return model
