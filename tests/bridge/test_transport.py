"""Transports: packed buckets round-trip; the exporter's buckets reach an embedded engine on another gloo rank
by broadcast, and on the dst rank in-process, from a tp2 learner; on a GPU, CUDA IPC of one reused buffer
feeds the embedded engine in a second process, whose log-probs then equal the learner's."""

import pytest
import torch
import torch.distributed as dist
from helpers.bridge_layouts import POOL_TIMEOUT, _stages
from helpers.harness import pool

from megatron_gptoss.bridge.export import WeightExporter
from megatron_gptoss.bridge.plan import EngineLayout
from megatron_gptoss.bridge.transport import broadcast_buckets, sync_in_process
from megatron_gptoss.config import gpt_oss_tiny
from megatron_gptoss.engine_api.buckets import ALIGN, pack, unpack
from megatron_gptoss.model import build_model
from megatron_gptoss.rollout import EmbeddedEngine

CONFIG = gpt_oss_tiny(attention_backend="eager")
VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def learner_state(seed=0):
    model = build_model(CONFIG, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_weights(engine_params, state):
    assert sorted(engine_params) == sorted(state)
    for name, value in state.items():
        rows = CONFIG.vocab_size if name in VOCAB_PARAMS else None
        assert torch.equal(engine_params[name][:rows], value[:rows]), name


def test_pack_unpack_round_trip_with_alignment_and_reuse():
    pairs = [
        ("a", torch.randn(3, 5)),
        ("b", torch.randn(7).bfloat16()),
        ("c", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]
    buffer, metas = pack(pairs)
    assert [m[3] % ALIGN for m in metas] == [0, 0, 0] and buffer.numel() == 3 * ALIGN
    for (name, value), (got_name, got) in zip(pairs, unpack(buffer, metas)):
        assert name == got_name and got.dtype == value.dtype and torch.equal(got, value)
    big = torch.empty(4 * ALIGN, dtype=torch.uint8)
    used, _ = pack(pairs, out=big)
    assert used.data_ptr() == big.data_ptr()  # a large enough buffer is reused


def broadcast_to_rank1(state, parallel):
    chunks, dims = _stages(CONFIG, state, parallel)
    exporter = WeightExporter(chunks, CONFIG, dims, EngineLayout(), bucket_bytes=4096, dst=0)
    group = dist.new_group(list(range(dims.layout.world)))
    stream = broadcast_buckets(exporter.buckets(), src=0, group=group, device="cpu")
    if dims.rank != 1:
        for _ in stream:
            pass
        return None
    engine = EmbeddedEngine(CONFIG)
    engine.update_weights(pair for bucket in stream for pair in bucket)
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def in_process_on_rank0(state, parallel):
    chunks, dims = _stages(CONFIG, state, parallel)
    exporter = WeightExporter(chunks, CONFIG, dims, EngineLayout(), bucket_bytes=4096, dst=0)
    engine = EmbeddedEngine(CONFIG) if dims.rank == 0 else None
    sync_in_process(exporter.buckets(), engine, is_dst=dims.rank == 0)
    return None if engine is None else {n: p.detach().clone() for n, p in engine.model.named_parameters()}


@pytest.mark.parametrize("how", [broadcast_to_rank1, in_process_on_rank0], ids=["broadcast", "in_process"])
def test_tp2_learner_feeds_an_embedded_engine(how):
    state = learner_state(seed=4)
    results = pool(2).run(how, state, {"tensor_model_parallel_size": 2}, timeout=POOL_TIMEOUT)
    (received,) = [r for r in results if r is not None]
    assert_same_weights(received, state)


# ------------------------------------------------------------------------------------------------
# CUDA IPC (GPU)
def ipc_receiver(control, acks, sequences):
    """Second process: the embedded engine on cuda:0, fed bucket by bucket from IPC handles."""
    from megatron_gptoss.engine_api.ipc import receive_ipc

    engine = EmbeddedEngine(CONFIG, device="cuda")
    results = []
    while True:
        message = control.get()
        if message == "done":
            break
        if message == "sync":

            def pairs():
                while (item := control.get()) != "end":
                    handle, metas = item
                    yield from receive_ipc(handle, metas)
                    acks.put("copied")

            engine.update_weights(pairs())
            with torch.no_grad():
                ids = torch.tensor(sequences, device="cuda")
                hidden = engine.model.hidden_states(ids[:, :-1])
                lp, _ = engine.model.token_logprobs(hidden, ids[:, 1:])
            results.append(lp.cpu())
            acks.put(results[-1])


@pytest.mark.gpu
def test_cuda_ipc_feeds_the_embedded_engine_in_a_second_process():
    from megatron_gptoss.engine_api.ipc import IpcSender

    ctx = torch.multiprocessing.get_context("spawn")
    control, acks = ctx.Queue(), ctx.Queue()
    gen = torch.Generator().manual_seed(0)
    sequences = torch.randint(0, CONFIG.vocab_size, (3, 20), generator=gen).tolist()
    receiver = ctx.Process(target=ipc_receiver, args=(control, acks, sequences), daemon=True)
    receiver.start()
    model = build_model(CONFIG, seed=0, device="cuda")
    sender = IpcSender(bucket_bytes=64 * 1024, device="cuda")  # above every transfer: no regrowth
    handle = sender.handle

    def deliver(handle, metas):
        control.put((handle, metas))
        assert acks.get(timeout=120) == "copied"  # the buffer is reused only after the copy

    try:
        for step in range(2):  # two syncs with an optimizer-like step between them: the buffer is reused
            if step:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.01 * torch.randn_like(p))
            control.put("sync")
            sender.send(WeightExporter([model], CONFIG, None, EngineLayout(), 64 * 1024).buckets(), deliver)
            control.put("end")
            theirs = acks.get(timeout=120)
            with torch.no_grad():
                ids = torch.tensor(sequences, device="cuda")
                ours, _ = model.token_logprobs(model.hidden_states(ids[:, :-1]), ids[:, 1:])
            assert (theirs - ours.cpu()).abs().max().item() <= 1e-6
        assert sender.handle == handle
    finally:
        control.put("done")
        receiver.join(timeout=60)
