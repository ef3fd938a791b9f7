"""The critic's starting weights: the policy's (the default) or the body of `critic.init_from_hf`, the head
from Normal(0, init_std) with the run's seed (a world of one, no engine)."""

import pytest
import torch

from megatron_gptoss.config import load_config
from megatron_gptoss.hf.io import save_hf
from megatron_gptoss.model import build_model
from megatron_gptoss.model.value import VALUE_HEAD
from megatron_gptoss.trainer.colocated import Colocated

BASE = ["algorithm.advantage=gae", "model.num_layers=2", "run.seed=3"]


pytestmark = pytest.mark.usefixtures("world_of_one")  # tests/trainer/conftest.py


def _setup(overrides):
    setup = Colocated(load_config("configs/demo_cpu.yaml", BASE + overrides), torch.device("cpu"), False)
    setup.initialise()
    policy = dict(setup.models[0].named_parameters())
    critic = dict(setup.critic[0].named_parameters())
    return setup, policy, critic


def test_critic_starts_from_the_policy_or_its_hf_directory(tmp_path):
    setup, policy, critic = _setup([])
    assert set(critic) == (set(policy) - {"output_layer.weight"}) | {VALUE_HEAD}
    assert all(torch.equal(critic[n], policy[n]) for n in critic if n != VALUE_HEAD)
    head = torch.randn(critic[VALUE_HEAD].shape, generator=torch.Generator().manual_seed(3))
    assert torch.equal(critic[VALUE_HEAD], head * setup.cfg.model.init_std)

    source = build_model(setup.cfg.model, seed=77)
    save_hf(source, tmp_path / "hf", dtype=torch.float32)
    setup, policy, critic = _setup([f"critic.init_from_hf={tmp_path / 'hf'}"])
    expected = dict(source.named_parameters())
    for name, p in critic.items():
        if name != VALUE_HEAD:
            assert torch.equal(p, expected[name]), name
            assert not torch.equal(p, policy[name]) or name.endswith(
                ("bias", "layernorm.weight", "norm_weight")
            )
    assert torch.equal(critic[VALUE_HEAD], head * setup.cfg.model.init_std)
