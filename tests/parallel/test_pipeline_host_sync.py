"""The pp = 1 training step of the pipeline runner keeps no data-dependent host sync: document boundaries
come from the host (computed when packing), and the per-row gathers use index tensors built on the host.
Checked by structure on the CPU: the gathers run on meta tensors (where any data-dependent op raises),
and a step runs with the device-side boundary derivation disabled; the results equal the boolean-mask
formulas bitwise."""

import torch
from helpers.sharded import tiny_config

import megatron_gptoss.parallel.pipeline as pipeline
from megatron_gptoss.config import ParallelConfig
from megatron_gptoss.model import build_model
from megatron_gptoss.parallel.dims import ParallelDims
from megatron_gptoss.parallel.pipeline import PipelineRunner, StagePlan, pack_micro_batches
from megatron_gptoss.utils.host import to_device


def packed_example():
    lengths = [5, 9, 3, 0, 7]
    width = max(lengths)
    valid = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    ids = (torch.arange(len(lengths) * width).view(len(lengths), width) % 90) * valid
    return pack_micro_batches(ids, (ids + 1) % 96, valid, token_budget=12, multiple_of=2), valid


def test_boundaries_known_on_the_host_at_packing():
    packed, _ = packed_example()
    assert packed.boundaries is not None and len(packed.boundaries) == packed.num_micro_batches
    for m, (cu, longest) in enumerate(packed.boundaries):
        ref_cu, ref_longest = pipeline.cu_seqlens_from_positions(packed.positions[m])
        assert cu.device.type == "cpu" and cu.dtype == torch.int32
        assert torch.equal(cu, ref_cu) and longest == ref_longest
    assert packed.boundaries[1][0].tolist() == [0, 9, 12]


def test_row_gathers_need_no_data_dependent_op_and_match_the_mask_formula():
    packed, _ = packed_example()
    meta = torch.empty(packed.token_budget, device="meta", requires_grad=True)
    assert packed.micro_rows(1, meta).shape == (2, packed.shape[1])  # boolean-mask indexing raises on meta
    assert packed.unpack(torch.empty(packed.input_ids.shape, device="meta")).shape == packed.shape

    gen = torch.Generator().manual_seed(5)
    values = torch.randn(packed.input_ids.shape, generator=gen)
    for m in range(packed.num_micro_batches):
        keep = packed.local_row_of[m] >= 0
        want = torch.zeros(len(packed.rows[m]), packed.shape[1])
        want[packed.local_row_of[m][keep], packed.col_of[m][keep]] = values[m][keep]
        assert torch.equal(packed.micro_rows(m, values[m]), want)
    keep = packed.row_of >= 0
    want = torch.zeros(packed.shape)
    want[packed.row_of[keep], packed.col_of[keep]] = values[keep]
    assert torch.equal(packed.unpack(values), want)


def test_micro_rows_gradient_reaches_every_packed_token_once():
    packed, _ = packed_example()
    values = torch.randn(packed.token_budget, requires_grad=True)
    packed.micro_rows(1, values).sum().backward()
    keep = (packed.local_row_of[1] >= 0).float()
    assert torch.equal(values.grad, keep)


def test_to_device_keeps_values_and_off_gpu_is_a_plain_copy():
    t = torch.arange(7)
    assert torch.equal(to_device(t, torch.device("cpu")), t)
    assert to_device(t, torch.device("meta")).device.type == "meta"


def test_single_stage_step_uses_the_host_boundaries(tmp_path, monkeypatch):
    import torch.distributed as dist

    config = tiny_config()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        dims = ParallelDims.build(ParallelConfig(), config)
        model = build_model(config, seed=3)
        runner = PipelineRunner([model], [StagePlan(0, 1, range(config.num_layers))], dims)
        packed, valid = packed_example()
        packed = runner.pack(packed.unpack(packed.input_ids), packed.unpack(packed.targets), valid, 12)
        mask = valid.float()

        def loss_fn(rows, lp, ent):
            return -(lp * mask[rows]).sum()

        ref_loss = runner.forward_backward(packed, loss_fn)
        ref_grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)

        def no_device_derivation(positions):
            raise AssertionError("document boundaries derived from the positions during the step")

        monkeypatch.setattr(pipeline, "cu_seqlens_from_positions", no_device_derivation)
        loss = runner.forward_backward(packed, loss_fn)
        assert torch.equal(loss, ref_loss)
        for p, g in zip(model.parameters(), ref_grads, strict=True):
            assert torch.equal(p.grad, g)
        monkeypatch.undo()
        model.zero_grad(set_to_none=True)
        packed.boundaries = None  # a batch packed without them still runs (derived on the host)
        assert torch.equal(runner.forward_backward(packed, loss_fn), ref_loss)
    finally:
        dist.destroy_process_group()


def test_stage_takes_the_padded_host_boundaries_of_the_pp_schedules(monkeypatch):
    packed, _ = packed_example()
    cu, longest = packed.boundary_tensors()
    assert cu.shape == (packed.num_micro_batches, 3) and cu.dtype == torch.int32
    assert cu[0].tolist() == [0, 5, 12] and cu[2].tolist() == [0, 7, 12] and cu[3].tolist() == [0, 12, 12]
    assert longest.tolist() == [b[1] for b in packed.boundaries]

    config = tiny_config()
    model = build_model(config, seed=4)
    stage = pipeline.StageModule(model, StagePlan(0, 1, range(config.num_layers)))
    for m in range(packed.num_micro_batches):
        ids, pos, tgt = (t[m : m + 1] for t in (packed.input_ids, packed.positions, packed.targets))
        want = stage(ids, positions=pos, targets=tgt)  # boundaries derived from the positions
        with monkeypatch.context() as patch:
            patch.setattr(pipeline, "cu_seqlens_from_positions", None)  # must not be called
            got = stage(
                ids, positions=pos, targets=tgt, cu_seqlens=cu[m : m + 1], max_seqlen=longest[m : m + 1]
            )
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
