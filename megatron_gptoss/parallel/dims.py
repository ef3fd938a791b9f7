"""`ParallelDims`: the parallel layout and every process group, built once and passed explicitly.

Rank order (Megatron's default, tensor fastest, then context):
    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

    dense parts   world = pp x dp x cp x tp; the cp ranks of a group hold the same weights and each
                  a load-balanced part of every packed micro-batch's tokens (`context_parallel`);
                  dense gradients are summed over dp x cp (the dp_cp group)
    experts       within one pipeline stage the dp x cp x tp ranks (tp fastest) are regrouped as
                  edp x ep (expert tensor parallel 1): consecutive blocks of `ep` ranks hold all
                  experts between them (the ep group); ranks at the same position of every block
                  replicate the same experts (the expert-data-parallel group, edp = dp x cp x tp / ep).
    groups        tp, cp, dp (same tp, cp, pp: the replicas that split a batch's rows), dp_cp (same
                  tp and pp: dense gradients and their optimizer shards), pp, ep, edp, mp (tp x pp of
                  one (dp, cp) position: one replica of the dense model).

Example, 8 ranks as tp2 x dp2 x pp2, ep2:  stage 0 = ranks 0..3, tp groups {0,1} {2,3}, dp groups
{0,2} {1,3}, ep groups {0,1} {2,3}, edp groups {0,2} {1,3}; pp groups {0,4} {1,5} {2,6} {3,7}.
Example, 8 ranks as tp2 x cp2 x dp2, ep4: tp {0,1} {2,3} {4,5} {6,7}; cp {0,2} {1,3} {4,6} {5,7};
dp {0,4} {1,5} {2,6} {3,7}; dp_cp {0,2,4,6} {1,3,5,7}; ep {0,1,2,3} {4,5,6,7}: experts carved from
the cp and tp ranks; edp {0,4} {1,5} {2,6} {3,7}.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_gptoss.config import ModelConfig, ParallelConfig
from megatron_gptoss.errors import LayoutError


@dataclass(frozen=True)
class Layout:
    """Pure arithmetic of a layout (no processes): sizes, a rank's coordinates, group memberships."""

    world: int
    tp: int
    pp: int
    ep: int
    vpp: int = 1
    cp: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.dp * self.cp * self.tp // self.ep

    def rank_of(self, tp: int, cp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> dict[str, int]:
        """tp/cp/dp/pp rank of `rank`, and its ep/edp rank inside its pipeline stage."""
        stage = self.tp * self.cp * self.dp
        local = rank % stage
        return {
            "tp": rank % self.tp,
            "cp": (rank // self.tp) % self.cp,
            "dp": (rank // (self.tp * self.cp)) % self.dp,
            "pp": rank // stage,
            "ep": local % self.ep,
            "edp": local // self.ep,
        }

    def groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, as sorted rank lists, in a fixed order (all ranks create them alike)."""
        tp, cp, dp, pp, ep = self.tp, self.cp, self.dp, self.pp, self.ep
        at = self.rank_of
        stage = tp * cp * dp
        kinds = ("tp", "cp", "dp", "dp_cp", "pp", "ep", "edp", "mp")
        out: dict[str, list[list[int]]] = {kind: [] for kind in kinds}
        cells = [(c, d) for d in range(dp) for c in range(cp)]
        for p in range(pp):
            for c, d in cells:
                out["tp"].append([at(t, c, d, p) for t in range(tp)])
            for d in range(dp):
                for t in range(tp):
                    out["cp"].append([at(t, c, d, p) for c in range(cp)])
            for c in range(cp):
                for t in range(tp):
                    out["dp"].append([at(t, c, d, p) for d in range(dp)])
            for t in range(tp):
                out["dp_cp"].append(sorted(at(t, c, d, p) for c, d in cells))
            for block in range(stage // ep):
                out["ep"].append([p * stage + block * ep + e for e in range(ep)])
            for e in range(ep):
                out["edp"].append([p * stage + block * ep + e for block in range(stage // ep)])
        for c, d in cells:
            for t in range(tp):
                out["pp"].append([at(t, c, d, p) for p in range(pp)])
        # model-parallel group: the ranks that together hold one replica of the dense model (tp x pp)
        for c, d in cells:
            out["mp"].append(sorted(at(t, c, d, p) for p in range(pp) for t in range(tp)))
        return out


def validate_layout(cfg: ParallelConfig, model: ModelConfig, world_size: int) -> Layout:
    """The layout for `world_size` ranks, or a LayoutError naming the numbers that do not divide."""
    cfg.validate()
    tp, pp, ep, vpp, cp = (
        cfg.tensor_model_parallel_size,
        cfg.pipeline_model_parallel_size,
        cfg.expert_model_parallel_size,
        cfg.virtual_pipeline_model_parallel_size,
        cfg.context_parallel_size,
    )
    if world_size % (tp * cp * pp):
        sizes = [f"tensor_model_parallel_size={tp}", f"pipeline_model_parallel_size={pp}"]
        if cp > 1:
            sizes.insert(1, f"context_parallel_size={cp}")
        raise LayoutError(f"world size {world_size} is not divisible by {' x '.join(sizes)}")
    layout = Layout(world_size, tp, pp, ep, vpp, cp)
    if (layout.dp * cp * tp) % ep:
        raise LayoutError(
            f"expert_model_parallel_size={ep} does not divide data-parallel x context-parallel x "
            f"tensor-parallel = {layout.dp} x {cp} x {tp} ranks of a pipeline stage"
        )
    if model.num_attention_heads % tp:
        raise LayoutError(f"num_attention_heads={model.num_attention_heads} not divisible by tp={tp}")
    if model.num_query_groups % tp:
        raise LayoutError(f"num_query_groups (KV heads)={model.num_query_groups} not divisible by tp={tp}")
    if model.num_experts % ep:
        raise LayoutError(f"num_experts={model.num_experts} not divisible by expert_model_parallel_size={ep}")
    if model.num_layers < pp * vpp:
        raise LayoutError(
            f"num_layers={model.num_layers} < pipeline_model_parallel_size={pp} x virtual stages={vpp}: "
            "every (virtual) stage needs a layer"
        )
    if cfg.sequence_parallel and tp == 1:
        raise LayoutError("sequence_parallel needs tensor_model_parallel_size > 1")
    return layout


@dataclass
class ParallelDims:
    """The layout plus this rank's coordinates and process groups. Build with `ParallelDims.build`."""

    layout: Layout
    rank: int
    sequence_parallel: bool = False
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    members: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, cfg: ParallelConfig, model: ModelConfig) -> ParallelDims:
        """Create every process group (collective over the whole world, same order on every rank)."""
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelDims.build needs torch.distributed initialised (torchrun or init_process_group)"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = validate_layout(cfg, model, world)
        dims = cls(layout, rank, cfg.sequence_parallel)
        for kind, ranks_list in layout.groups().items():
            for ranks in ranks_list:
                group = dist.new_group(ranks)
                if rank in ranks:
                    dims.groups[kind], dims.members[kind] = group, ranks
        return dims

    # sizes and ranks ---------------------------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def edp(self) -> int:
        return self.layout.edp

    @property
    def vpp(self) -> int:
        return self.layout.vpp

    def coord(self, kind: str) -> int:
        return self.layout.coords(self.rank)[kind]

    def group(self, kind: str) -> dist.ProcessGroup:
        """The process group of `kind` (tp, cp, dp, dp_cp, pp, ep, edp, mp) this rank belongs to."""
        if kind not in self.groups:
            raise KeyError(f"no process group {kind!r}; known: {sorted(self.groups)}")
        group = self.groups[kind]
        assert group is not None
        return group
