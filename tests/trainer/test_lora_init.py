"""A LoRA run's start from an HF directory (a world of one, no engine): the base is the directory's weights,
frozen; the adapters start as LoRA.reset does (A uniform in +-1/sqrt(in), B zero); the optimizer holds the
adapters only; the checkpointer names the directory as the base; a LoRA critic is refused."""

import pytest
import torch

from megatron_gptoss.checkpoint.distributed import DistributedCheckpointer
from megatron_gptoss.config import ConfigError, load_config
from megatron_gptoss.hf.io import save_hf
from megatron_gptoss.model import build_model
from megatron_gptoss.model.lora import base_config, is_adapter_param
from megatron_gptoss.trainer.colocated import Colocated

pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/trainer/conftest.py
LORA = ["model.lora.rank=2", "model.num_layers=2", "run.seed=3"]


def test_lora_starts_from_the_hf_base_with_fresh_adapters(tmp_path):
    cfg = load_config("configs/demo_cpu.yaml", [*LORA, f"run.output_dir={tmp_path / 'out'}"])
    source = build_model(base_config(cfg.model), seed=77)
    save_hf(source, tmp_path / "hf", dtype=torch.float32)
    cfg = load_config(
        "configs/demo_cpu.yaml",
        [*LORA, f"run.init_from_hf={tmp_path / 'hf'}", f"run.output_dir={tmp_path / 'out'}"],
    )
    setup = Colocated(cfg, torch.device("cpu"), False)
    setup.initialise()
    setup.build_optimizer()
    expected = dict(source.named_parameters())
    adapters = 0
    for name, p in setup.models[0].named_parameters():
        if is_adapter_param(name):
            adapters += 1
            assert p.requires_grad, name
            if name.endswith(".b"):
                assert not p.any(), name
            else:
                bound = 1 / p.shape[-1] ** 0.5
                assert 0 < float(p.abs().max()) <= bound and float(p.std()) > bound / 4, name
        else:
            assert not p.requires_grad and torch.equal(p, expected[name]), name
    assert adapters == 2 * 4 * 2  # a and b of the 4 default targets in 2 layers
    assert setup.optimizer is not None
    held = {id(p) for bucket in setup.optimizer.buckets for p in bucket.params}
    assert held == {id(p) for n, p in setup.models[0].named_parameters() if is_adapter_param(n)}
    checkpointer = DistributedCheckpointer.for_run(cfg, setup.dims)
    assert checkpointer.base_reference() == {"init_from_hf": str(tmp_path / "hf")}


def test_a_lora_critic_is_refused():
    with pytest.raises(ConfigError, match="LoRA critics are not supported"):
        load_config("configs/demo_cpu.yaml", [*LORA, "algorithm.advantage=gae"])
