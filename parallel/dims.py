"""ParallelDims: how tp × cp × pp × dp ranks are laid out, and their process groups.

The world is a 4-D grid of shape (pp, dp, cp, tp), row-major, tp innermost (so a TP
group is a run of consecutive ranks and stays inside one node), context parallelism next
(its ring or all-to-all traffic is the heaviest after TP's):

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

The examples below have cp = 1, where the grid is (pp, dp, tp).

Example, tp=2 pp=2 dp=2 (world 8)::

                 dp_rank 0     dp_rank 1
    pp_rank 0    [0, 1]        [2, 3]        <- [..] is one TP group
    pp_rank 1    [4, 5]        [6, 7]

    tp groups  {0,1} {2,3} {4,5} {6,7}      same (pp, dp): one layer split over these
    dp groups  {0,2} {1,3} {4,6} {5,7}      same (pp, tp): replicas of one model shard
    pp groups  {0,4} {1,5} {2,6} {3,7}      same (dp, tp): the stages of one pipeline
    mp groups  {0,1,4,5} {2,3,6,7}          same dp: the whole model (tp × pp), the
                                            ``model_parallel_group`` of a ZeroOptimizer
    embedding  {0,4} {1,5} {2,6} {3,7}      first + last stage, same (dp, tp): the two
                                            copies of a tied embedding (None if pp == 1)

Hybrid sharding splits dp into dp_replicate × dp_shard, dp_shard inner:

    dp_rank = replicate_rank · dp_shard + shard_rank

so a shard group (ZeroOptimizer's sharding group) is dp_shard runs of tp consecutive ranks,
inside one node when dp_shard · tp divides the ranks per node; the replicate group joins
the ranks holding the same shard in each replica. E.g. tp=1 pp=1 dp=4 dp_shard=2: shard
groups {0,1} {2,3}, replicate groups {0,2} {1,3}. Without dp_shard (dp_shard = dp) there is
no replicate group and the shard group is the dp group.

Context parallelism splits each sequence over cp ranks holding the same parameters, so
their gradients are reduced, and ZeRO shards, over dp × cp: the dp_cp group (the ranks of
one (pp, tp) cell) and, with hybrid sharding, shard groups of dp_shard × cp ranks. Inside
a cp group, runs of cp_a2a consecutive ranks exchange heads by all-to-all and the ranks at
the same place in each run form the ring (`parallel.context.ContextGroups`). E.g. tp=1 pp=1
dp=2 cp=2: cp groups {0,1} {2,3}, dp groups {0,2} {1,3}, dp_cp {0,1,2,3}.

Expert parallelism borrows data-parallel ranks (as DeepSpeed-MoE and torchtitan do, and
context-parallel ones as Megatron's MoE parallel folding does): ep consecutive ranks of a
shard group exchange tokens and split an MoE layer's experts, so ep divides dp_shard · cp. The ranks of a shard group holding the same experts (shard rank ≡ s mod
ep) are the expert shard group, over which ZeRO shards and reduces the experts; across
replicas they are the replicate group. E.g. tp=1 pp=1 dp=4 ep=2: ep groups {0,1} {2,3},
expert shard groups {0,2} {1,3}.

Nodes: ranks [n·k, (n+1)·k) are node n, k = ``ranks_per_node`` (torchrun's
``$LOCAL_WORLD_SIZE``, its processes per node); ``crosses_nodes(group)`` says whether a
group's traffic leaves a node.

``ParallelDims(...)`` only validates (no process group is touched), so a bad layout
fails with one sentence before anything could hang. ``build()`` then creates the
``DeviceMesh`` (dims "pp", "dp", "cp", "tp") and the mp / embedding groups, and labels
every group for ``parallel.comm``'s per-group byte accounting.

Every group is its own ProcessGroup object, even when it spans all ranks or has
one rank. Left alone, ``init_device_mesh`` hands back the default (WORLD) group
for a dimension whose size is the world size (e.g. tp at tp=8 on 8 ranks; every
dimension at world size 1); labelling that as "tp" would also relabel every
``group=None`` call and, at world size 1, merge all dimensions into one label.
``build()`` therefore asks the mesh for a fresh group on such dimensions (a
``backend_override`` with the default backend), and creates mp / embedding with
``new_group`` in an order every rank shares.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel import accounting, desync
from parallel.context.groups import ContextGroups
from parallel.expert.groups import ExpertGroups

__all__ = ["LayoutError", "ParallelDims"]

MESH_DIMS = ("pp", "dp", "cp", "tp")  # outermost first; tp innermost


def _default_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


class LayoutError(ValueError):
    """A (tp, pp, dp, world size) that cannot be laid out, in one sentence naming the sizes at
    fault; `worded(name)` is the same sentence with each size called `name(size)` (a config
    names its flags)."""

    def __init__(self, template: str, sizes: tuple[str, ...]) -> None:
        self.template, self.sizes = template, sizes
        super().__init__(self.worded(str))

    def worded(self, name: Callable[[str], str]) -> str:
        return self.template.format(**{size: name(size) for size in self.sizes})


def _check_positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        shown = repr(value).replace("{", "{{").replace("}", "}}")  # literal text of the template
        raise LayoutError(f"{{{name}}}={shown} must be a positive integer", (name,))


def _default_ranks_per_node(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def _check_world(tp: int, pp: int, dp: int | None, world: int, where: str = "", cp: int = 1) -> int:
    """dp (inferred as world / (tp·cp·pp) when None), once tp·cp·pp divides the world size
    and tp·cp·pp·dp equals it."""
    sizes, names = (tp, cp, pp), ("tp", "cp", "pp")
    if cp == 1:
        sizes, names = (tp, pp), ("tp", "pp")
    product = math.prod(sizes)
    factors = " × ".join(f"{{{n}}}={s}" for n, s in zip(names, sizes))
    if dp is None:
        if world % product:
            raise LayoutError(f"{factors} = {product} does not divide the world size {world}", names)
        return world // product
    if product * dp != world:
        raise LayoutError(
            f"{factors} × {{dp}}={dp} = {product * dp} does not equal the world size {world}{where}", (*names, "dp")
        )
    return dp


@dataclass
class ParallelDims:
    """Sizes of the four parallel dimensions; ``build()`` makes their groups.

    Args:
        tp: tensor-parallel size (ranks that split one layer's matmuls).
        pp: pipeline-parallel size (stages).
        dp: data-parallel size; None infers ``world_size // (tp·cp·pp)``.
        world_size: default ``dist.get_world_size()`` if a process group exists,
            else ``$WORLD_SIZE`` (set by torchrun), else 1.
        dp_shard: hybrid sharding: ZeRO shards over groups of this many dp ranks and the
            dp / dp_shard replicas reduce gradients across them; None = dp (no replicas).
        ep: expert parallelism: MoE experts split over this many consecutive ranks of each
            shard group (it divides dp_shard · cp); 1: every rank holds every expert.
        cp: context parallelism: each sequence split over this many ranks.
        cp_a2a: ranks of each all-to-all group inside a cp group (1: the ring alone; cp:
            all-to-all alone; between: hybrid, the ring across the groups); it divides cp.
        ranks_per_node: processes per node (default ``$LOCAL_WORLD_SIZE``, else the world).

    Raises ``LayoutError`` (a ``ValueError``) with one sentence for an invalid layout,
    before any process group exists.

    After ``build()``: ``mesh``; the groups ``tp_group``, ``pp_group``, ``dp_group``,
    ``cp_group``, ``dp_cp_group`` (the ranks holding this rank's parameters: dp × cp),
    ``mp_group`` (tp × pp: the ranks sharing this rank's dp and cp coordinates) and
    ``embedding_group``, ``dp_shard_group`` and ``dp_replicate_group`` (None without
    replicas); ``context`` and ``expert_groups``; this rank's coordinates ``tp_rank``,
    ``pp_rank``, ``dp_rank``, ``cp_rank``; ``is_first_stage`` / ``is_last_stage``; ``prev_stage_rank`` /
    ``next_stage_rank`` (global ranks, None at the pipeline's ends).
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    world_size: int | None = None
    dp_shard: int | None = None
    ranks_per_node: int | None = None
    ep: int = 1
    cp: int = 1
    cp_a2a: int = 1

    # Set by build(); not part of the layout's identity.
    _mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, init=False, repr=False, compare=False)
    _coord: tuple[int, int, int, int] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size is None:
            self.world_size = _default_world_size()
        _check_positive("tp", self.tp)
        _check_positive("pp", self.pp)
        _check_positive("cp", self.cp)
        if self.dp is not None:
            _check_positive("dp", self.dp)
        _check_positive("world_size", self.world_size)
        self.dp = _check_world(self.tp, self.pp, self.dp, self.world_size, cp=self.cp)
        _check_positive("cp_a2a", self.cp_a2a)
        if self.cp % self.cp_a2a:
            raise LayoutError(
                f"{{cp_a2a}}={self.cp_a2a} does not divide {{cp}}={self.cp}: the cp ranks form rings of "
                "all-to-all groups of that size",
                ("cp_a2a", "cp"),
            )
        if self.dp_shard is None:
            self.dp_shard = self.dp
        _check_positive("dp_shard", self.dp_shard)
        if self.dp % self.dp_shard:
            raise LayoutError(
                f"{{dp_shard}}={self.dp_shard} does not divide {{dp}}={self.dp}: hybrid sharding needs "
                "dp = replicas × dp_shard",
                ("dp_shard", "dp"),
            )
        _check_positive("ep", self.ep)
        if (self.dp_shard * self.cp) % self.ep:
            shard = "dp_shard" if self.dp_shard != self.dp else "dp"
            times = f" × {{cp}}={self.cp}" if self.cp > 1 else ""
            raise LayoutError(
                f"{{ep}}={self.ep} does not divide {{{shard}}}={self.dp_shard}{times}: expert parallelism splits "
                "the experts over ranks of one shard group",
                ("ep", shard, *(("cp",) if self.cp > 1 else ())),
            )
        if self.ranks_per_node is None:
            self.ranks_per_node = _default_ranks_per_node(self.world_size)
        _check_positive("ranks_per_node", self.ranks_per_node)

    def __str__(self) -> str:
        hybrid = f" ({self.dp_replicate}×{self.dp_shard})" if self.dp_replicate > 1 else ""
        experts = f" ep={self.ep}" if self.ep > 1 else ""
        context = f" cp={self.cp}" + (f" (all-to-all {self.cp_a2a})" if self.cp_a2a > 1 else "") if self.cp > 1 else ""
        return f"tp={self.tp}{context} pp={self.pp} dp={self.dp}{hybrid}{experts} (world {self.world_size})"

    @property
    def dp_replicate(self) -> int:
        """Replicas of the sharded model states: dp / dp_shard."""
        return self.dp // self.dp_shard

    def crosses_nodes(self, ranks: list[int]) -> bool:
        """Whether these global ranks sit on more than one node."""
        return len({r // self.ranks_per_node for r in ranks}) > 1

    # ------------------------------------------------------------------
    # Pure layout arithmetic (no process group needed)
    # ------------------------------------------------------------------

    def rank_of(self, pp_rank: int, dp_rank: int, cp_rank: int, tp_rank: int) -> int:
        """Global rank at grid coordinate (pp_rank, dp_rank, cp_rank, tp_rank)."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coords_of(self, rank: int) -> tuple[int, int, int, int]:
        """(pp_rank, dp_rank, cp_rank, tp_rank) of a global rank; inverse of ``rank_of``."""
        rest, tp_rank = divmod(rank, self.tp)
        rest, cp_rank = divmod(rest, self.cp)
        pp_rank, dp_rank = divmod(rest, self.dp)
        return pp_rank, dp_rank, cp_rank, tp_rank

    def with_tp_rank(self, rank: int, tp_rank: int) -> int:
        """The global rank at `rank`'s coordinates but tp rank `tp_rank`."""
        return rank - rank % self.tp + tp_rank

    # ------------------------------------------------------------------
    # Process groups
    # ------------------------------------------------------------------

    def build(self, device_type: str | None = None, timeout_s: float | None = None) -> ParallelDims:
        """Create the DeviceMesh and all groups on every rank (collective); returns self.

        Initializes the default process group from the torchrun environment if none
        exists yet. With ``timeout_s`` every group (the default one too) times out a
        collective after that many seconds (else torch's default, 30 minutes on gloo).
        Calling it again on a built instance does nothing.
        """
        if self._mesh is not None:
            return self
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if not dist.is_initialized():
            dist.init_process_group(timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
        actual = dist.get_world_size()
        _check_world(self.tp, self.pp, self.dp, actual, " of the default process group", self.cp)

        shape = (self.pp, self.dp, self.cp, self.tp)
        # A dim spanning all ranks would get the WORLD group itself: ask for a fresh one.
        backend = dist.get_backend()
        override = {n: backend for n, size in zip(MESH_DIMS, shape) if size == actual}
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS, backend_override=override or None)

        groups = {name: mesh.get_group(name) for name in MESH_DIMS} | self._cross_groups()
        for name, group in groups.items():
            if group is not None:
                accounting.set_group_name(group, name)
        if timeout_s is not None:
            desync.set_timeout(timeout_s, [None, *(g for g in groups.values() if g is not None)])

        coord = self.coords_of(dist.get_rank())
        assert tuple(mesh.get_coordinate()) == coord, (mesh.get_coordinate(), coord)
        self._mesh, self._groups, self._coord = mesh, groups, coord
        return self

    def _cross_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """mp: the tp × pp ranks sharing (dp, cp) coordinates; embedding: first + last stage
        sharing (dp, cp, tp), None when pp == 1. Created in the same order on every rank
        (collective)."""
        cells = [(d, c) for d in range(self.dp) for c in range(self.cp)]
        mp_group, _ = dist.new_subgroups_by_enumeration(
            [[self.rank_of(p, d, c, t) for p in range(self.pp) for t in range(self.tp)] for d, c in cells],
            group_desc="mp",
        )
        embedding_group = None
        if self.pp > 1:
            embedding_group, _ = dist.new_subgroups_by_enumeration(
                [
                    [self.rank_of(0, d, c, t), self.rank_of(self.pp - 1, d, c, t)]
                    for d, c in cells
                    for t in range(self.tp)
                ],
                group_desc="embedding",
            )
        return {
            "mp": mp_group,
            "embedding": embedding_group,
            **self._context_groups(),
            **self._hybrid_groups(),
            **self._node_groups(),
            **self._expert_groups(),
        }

    def _context_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """dp_cp: the dp × cp ranks of one (pp, tp) cell, holding the same parameters; cp_a2a
        and cp_ring: a hybrid cp group's all-to-all runs and rings. None when cp == 1 (and the
        two when not hybrid: the cp group is then the ring or the all-to-all group itself)."""
        none = {"dp_cp": None, "cp_a2a": None, "cp_ring": None}
        if self.cp == 1:
            return none
        cells = [(p, t) for p in range(self.pp) for t in range(self.tp)]
        dp_cp, _ = dist.new_subgroups_by_enumeration(
            [[self.rank_of(p, d, c, t) for d in range(self.dp) for c in range(self.cp)] for p, t in cells],
            group_desc="dp_cp",
        )
        groups = none | {"dp_cp": dp_cp}
        a = self.cp_a2a
        if 1 < a < self.cp:
            cp_groups = [[self.rank_of(p, d, c, t) for c in range(self.cp)] for p, t in cells for d in range(self.dp)]
            groups["cp_a2a"], _ = dist.new_subgroups_by_enumeration(
                [ranks[i : i + a] for ranks in cp_groups for i in range(0, self.cp, a)], group_desc="cp_a2a"
            )
            groups["cp_ring"], _ = dist.new_subgroups_by_enumeration(
                [ranks[j::a] for ranks in cp_groups for j in range(a)], group_desc="cp_ring"
            )
        return groups

    def _expert_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """ep: ep consecutive ranks of a shard group; ep_shard: the ranks of a shard group at
        the same place in their ep groups (the same experts). None when ep == 1."""
        if self.ep == 1:
            return {"ep": None, "ep_shard": None}
        shards = self.shard_groups()
        ep, _ = dist.new_subgroups_by_enumeration(
            [ranks[i : i + self.ep] for ranks in shards for i in range(0, len(ranks), self.ep)], group_desc="ep"
        )
        ep_shard, _ = dist.new_subgroups_by_enumeration(
            [ranks[j :: self.ep] for ranks in shards for j in range(self.ep)], group_desc="ep_shard"
        )
        return {"ep": ep, "ep_shard": ep_shard}

    def shard_groups(self) -> list[list[int]]:
        """The global ranks of every shard group (one replica's dp × cp ranks for each (pp, tp),
        cp inner)."""
        shard = self.dp_shard
        return [
            [self.rank_of(p, r * shard + s, c, t) for s in range(shard) for c in range(self.cp)]
            for p in range(self.pp)
            for t in range(self.tp)
            for r in range(self.dp_replicate)
        ]

    def _node_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """dp_shard_node: the ranks of this rank's shard group on its node (ZeRO++ hpZ's
        secondary partition lives there); dp_shard_cross: the ranks of its shard group with
        its place in their node, one per node (qgZ's second all-to-all). Made only when shard
        groups cross nodes and every node holds as many ranks of each."""
        parts = [
            [
                [r for r in ranks if r // self.ranks_per_node == node]
                for node in sorted({r // self.ranks_per_node for r in ranks})
            ]
            for ranks in self.shard_groups()
        ]
        sizes = {len(node) for p in parts for node in p}
        if all(len(p) == 1 for p in parts) or len(sizes) > 1:  # inside a node, or split unevenly
            return {"dp_shard_node": None, "dp_shard_cross": None}
        node, _ = dist.new_subgroups_by_enumeration([node for p in parts for node in p], group_desc="dp_shard_node")
        cross, _ = dist.new_subgroups_by_enumeration(
            [[node[j] for node in p] for p in parts for j in range(len(p[0]))],
            group_desc="dp_shard_cross",
        )
        return {"dp_shard_node": node, "dp_shard_cross": cross}

    def _hybrid_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """dp_shard: the dp (× cp) ranks of one replica (the dp or dp_cp group without
        replicas); dp_replicate: the ranks holding the same shard in each replica (None without)."""
        if self.dp_replicate == 1:
            return {"dp_shard": None, "dp_replicate": None}
        shards, replicas = self.shard_groups(), self.dp_replicate  # each (pp, tp) cell's replicas in a row
        shard_group, _ = dist.new_subgroups_by_enumeration(shards, group_desc="dp_shard")
        replicate_group, _ = dist.new_subgroups_by_enumeration(
            [list(same) for i in range(0, len(shards), replicas) for same in zip(*shards[i : i + replicas])],
            group_desc="dp_replicate",
        )
        return {"dp_shard": shard_group, "dp_replicate": replicate_group}

    def _built(self) -> tuple[int, int, int, int]:
        if self._coord is None:
            raise RuntimeError(f"ParallelDims({self}) has no process groups yet: call build() first")
        return self._coord

    @property
    def mesh(self) -> DeviceMesh:
        """The DeviceMesh of shape (pp, dp, cp, tp), dims ("pp", "dp", "cp", "tp")."""
        self._built()
        assert self._mesh is not None
        return self._mesh

    @property
    def tp_group(self) -> dist.ProcessGroup:
        """Ranks with this rank's (pp, dp, cp) coordinates; labelled "tp"."""
        self._built()
        return self._groups["tp"]

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """Ranks with this rank's (dp, cp, tp) coordinates; labelled "pp"."""
        self._built()
        return self._groups["pp"]

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """Ranks with this rank's (pp, cp, tp) coordinates: the replicas of the model that read
        different sequences; labelled "dp"."""
        self._built()
        return self._groups["dp"]

    @property
    def cp_group(self) -> dist.ProcessGroup:
        """Ranks with this rank's (pp, dp, tp) coordinates, sharing its sequences; labelled "cp"."""
        self._built()
        return self._groups["cp"]

    @property
    def dp_cp_group(self) -> dist.ProcessGroup:
        """The dp × cp ranks holding this rank's parameters (the dp group when cp = 1), over
        which gradients are averaged; labelled "dp_cp" when distinct."""
        self._built()
        return self._groups["dp_cp"] or self._groups["dp"]

    @property
    def context(self) -> ContextGroups:
        """What a context-parallel attention of this rank communicates over
        (`parallel.context.ContextGroups`; its cp group None when cp == 1)."""
        self._built()
        if self.cp == 1:
            return ContextGroups()
        cp, a = self._groups["cp"], self.cp_a2a
        if a == 1:
            return ContextGroups(cp, None, cp)
        if a == self.cp:
            return ContextGroups(cp, cp, None)
        return ContextGroups(cp, self._groups["cp_a2a"], self._groups["cp_ring"])

    @property
    def dp_shard_group(self) -> dist.ProcessGroup:
        """The dp × cp ranks of this rank's replica, over which ZeRO shards (the dp_cp group
        when dp_shard = dp); labelled "dp_shard" when distinct."""
        self._built()
        return self._groups["dp_shard"] or self.dp_cp_group

    @property
    def dp_shard_node_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """(the ranks of this rank's shard group on its node, the ranks of its shard group at
        its place in each node): ZeroOptimizer's `node_groups` for ZeRO++ hpZ and qgZ. (The
        shard group, None) when it fits in one node; labelled "dp_shard_node" and
        "dp_shard_cross" when distinct."""
        self._built()
        return self._groups["dp_shard_node"] or self.dp_shard_group, self._groups["dp_shard_cross"]

    @property
    def dp_replicate_group(self) -> dist.ProcessGroup | None:
        """The ranks holding this rank's shard in each replica; None when dp_shard = dp;
        labelled "dp_replicate"."""
        self._built()
        return self._groups["dp_replicate"]

    @property
    def ep_group(self) -> dist.ProcessGroup | None:
        """The ranks splitting an MoE layer's experts with this one (None when ep == 1);
        labelled "ep"."""
        self._built()
        return self._groups["ep"]

    @property
    def ep_shard_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's shard group holding its experts, over which ZeRO shards
        and reduces them (the shard group when ep == 1); labelled "ep_shard"."""
        self._built()
        return self._groups["ep_shard"] or self.dp_shard_group

    @property
    def expert_groups(self) -> ExpertGroups:
        """What an MoE layer of this rank communicates over (`parallel.expert.ExpertGroups`)."""
        return ExpertGroups(self.ep_group, self.dp_cp_group, self.ep_shard_group, self.dp_replicate_group)

    @property
    def mp_group(self) -> dist.ProcessGroup:
        """The tp × pp ranks with this rank's dp and cp coordinates (one whole model);
        group rank = pp_rank·tp + tp_rank; labelled "mp"."""
        self._built()
        return self._groups["mp"]

    @property
    def embedding_group(self) -> dist.ProcessGroup | None:
        """{first stage, last stage} with this rank's (dp, cp, tp) coordinates, for tied
        embeddings; labelled "embedding". None when pp == 1 and on middle stages
        (which are not members)."""
        self._built()
        return self._groups["embedding"]

    @property
    def pp_rank(self) -> int:
        return self._built()[0]

    @property
    def dp_rank(self) -> int:
        return self._built()[1]

    @property
    def cp_rank(self) -> int:
        return self._built()[2]

    @property
    def tp_rank(self) -> int:
        return self._built()[3]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same dp, cp, tp); None on the first."""
        pp_rank, dp_rank, cp_rank, tp_rank = self._built()
        return None if pp_rank == 0 else self.rank_of(pp_rank - 1, dp_rank, cp_rank, tp_rank)

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next pipeline stage (same dp, cp, tp); None on the last."""
        pp_rank, dp_rank, cp_rank, tp_rank = self._built()
        return None if pp_rank == self.pp - 1 else self.rank_of(pp_rank + 1, dp_rank, cp_rank, tp_rank)
