"""One step of a :class:`.FlowGrouping` as a schedule :class:`~mindspeed_flow.schedule.Plan`.

The flow's two sides are grouped differently, so its plan numbers *groups*: ``mb0`` ..
``mb(B-1)`` are the encoder's batches, ``mbB`` .. ``mb(B+M-1)`` the backbone's microbatches
(``grouping.batches`` then ``grouping.microbatches``), and the seam between them is the pool
addressed per sample (:data:`mindspeed_flow.schedule.seams.FLOW`).  The ranks are
:class:`~.ranks.FlowRanks`' (the runtime's too):

- ranks ``0 .. E-1`` are the encoder replicas.  Each runs its batches in need order: the
  forward of a batch, then one ``PUT vit.s0 mbB smpS -> r<stage 0>`` per sample of it (to the
  first stage of the replica whose microbatch holds the sample).  A trainable encoder then
  ``GET``s each sample's gradient and runs the batch's backward, batches in the order their
  gradients complete on the backbone, and the replicas broadcast their parameters first and
  reduce their gradients last (the :class:`~mindspeed_flow.schedule.Decoupled` region's
  collectives).
- ranks ``E + d*PP + s`` are stage ``s`` of backbone replica ``d``.  Each replica runs the
  1F1B program :func:`~mindspeed_flow.schedule.compose` makes for its own microbatches, with
  stage 0 ``GET``ting every sample of a microbatch (with images) right before the microbatch's
  forward and, for a trainable encoder, ``PUT``ting each sample's gradient right after its
  backward.  The backbone's data-parallel gradient average is outside the plan, as in the
  decoupled layout (:mod:`mindspeed_flow.decoupled`).

:attr:`Plan.samples` says which samples each group moves, so :func:`~mindspeed_flow.schedule.validate`
follows every sample across the seam, and :func:`~mindspeed_flow.schedule.simulate` replays
the plan with :func:`.costs.flow_costs`.  Puts never block, and nothing the backbone runs
waits for an encoder backward, so the programs cannot deadlock.  The executor does not run
this plan (:func:`mindspeed_flow.runtime.lowering.refuse_per_sample`): the flow runs as
:class:`~.producer.EmbeddingProducer` on the encoder ranks and each backbone replica's plain
1F1B fed by :class:`~.consumer.EmbeddingConsumer` (:mod:`.backbone`): the same dataflow, with
the encoder's backwards in the order their gradients actually complete.
"""

from __future__ import annotations

from dataclasses import replace

from ..schedule import Action, Decoupled, Kind, OneFOneB, Plan, Region, compose
from ..schedule.keys import BoundaryKey, BoundaryKind
from ..schedule.placement import Placement, Visit
from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION, backward_kinds
from ..schedule.seams import FLOW
from .errors import GroupingError
from .grouping import FlowGrouping
from .ranks import FlowRanks

ACT_KEY = BoundaryKey(ENCODER_REGION, 0, BoundaryKind.ACT)
GRAD_KEY = ACT_KEY.of(BoundaryKind.GRAD)


def compose_flow(
    grouping: FlowGrouping,
    *,
    encoder_layers: int = 1,
    llm_layers: int | None = None,
    trainable_encoder: bool = True,
    semantics: str = "eager",
) -> Plan:
    """The per-rank programs of one step of ``grouping`` (see the module for the ranks and
    the group numbering).  ``llm_layers`` (default: one per stage) and ``encoder_layers``
    only weigh each stage's share of the costs; ``semantics`` is the backbone pipeline's.
    A grouping that lost or repeated a sample is refused first (:meth:`.FlowGrouping.check`)."""
    grouping.check(s.sample_id for s in grouping.samples)
    flow = _Flow(grouping, encoder_layers, llm_layers or grouping.pp, trainable_encoder)
    backbone = flow.backbone_programs(semantics)
    programs = {**flow.encoder_programs(backbone), **backbone}
    return Plan(
        regions=flow.regions,
        num_microbatches=len(flow.paths),
        programs={rank: tuple(programs[rank]) for rank in sorted(programs)},
        paths=flow.paths,
        roles=flow.roles(),
        semantics=semantics,
        samples=flow.samples(),
    )


class _Flow:
    """The facts every program of one flow step is built from."""

    def __init__(self, grouping: FlowGrouping, encoder_layers: int, llm_layers: int, trainable: bool) -> None:
        if llm_layers < grouping.pp:
            raise GroupingError(f"compose_flow: {llm_layers} LLM layers cannot fill {grouping.pp} pipeline stages")
        self.g = grouping
        self.encoders = grouping.encoder_replicas
        self.backbone = Region(BACKBONE_REGION, llm_layers, OneFOneB(stages=grouping.pp))
        self.regions = (Region(ENCODER_REGION, encoder_layers, Decoupled(ranks=self.encoders), trainable=trainable),
                        self.backbone)
        self.kinds = backward_kinds(self.regions)
        self.offset = len(grouping.batches)  # group number of LLM microbatch 0
        self.batch_of = {s: b for b, ids in enumerate(grouping.batches) for s in ids}
        self.microbatch_of = {s: m for m, ids in enumerate(grouping.microbatches) for s in ids}
        encoder = Visit(ENCODER_REGION, 0, 0, encoder_layers, 1.0, self.kinds[ENCODER_REGION], "start")
        stages = Placement([self.backbone]).path(0)
        self.paths = tuple(
            [(replace(encoder, rank=r),) for r in grouping.batch_replica]
            + [tuple(replace(v, rank=self.stage_rank(d, v.rank), inbound=FLOW if v.stage == 0 else v.inbound)
                     for v in stages) for d in grouping.microbatch_replica])

    def stage_rank(self, replica: int, stage: int) -> int:
        return FlowRanks.of(self.g).stage_rank(replica, stage)

    def pooled(self, microbatch: int) -> list[int]:
        """The samples of an LLM microbatch that travel through the pool (those with images)."""
        return [s for s in self.g.microbatches[microbatch] if s in self.batch_of]

    def samples(self) -> dict[int, tuple[int, ...]]:
        groups = {b: tuple(ids) for b, ids in enumerate(self.g.batches)}
        groups.update((self.offset + m, tuple(self.pooled(m))) for m in range(len(self.g.microbatches)))
        return groups

    def roles(self) -> dict[int, str]:
        roles = {e: f"{ENCODER_REGION}(flow) replica {e}" for e in range(self.encoders)}
        roles.update((self.stage_rank(d, s), f"{BACKBONE_REGION}.s{s} dp{d}")
                     for d in range(self.g.dp) for s in range(self.g.pp))
        return roles

    def encoder_programs(self, backbone: dict[int, list[Action]]) -> dict[int, list[Action]]:
        """Each encoder replica's program; ``backbone``'s programs say when gradients come back."""
        trainable = self.kinds[ENCODER_REGION] is not None
        group = tuple(range(self.encoders))
        ready = self._gradients_ready(backbone) if trainable else {}
        programs = {}
        for e in group:
            program: list[Action] = []
            if trainable and len(group) > 1:
                program.append(Action(Kind.PARAM_BROADCAST, ENCODER_REGION, group=group))
            batches = self.g.replica_batches(e)
            for b in batches:
                program.append(Action(Kind.FORWARD, ENCODER_REGION, 0, b))
                program += [self._encoder_transfer(Kind.POOL_PUT, b, s) for s in self.g.batches[b]]
            if trainable:
                for b in sorted(batches, key=lambda b: (ready[b], b)):
                    program += [self._encoder_transfer(Kind.POOL_GET, b, s) for s in self.g.batches[b]]
                    program.append(Action(Kind.BACKWARD, ENCODER_REGION, 0, b))
                if len(group) > 1:
                    program.append(Action(Kind.GRAD_REDUCE, ENCODER_REGION, group=group))
            programs[e] = program
        return programs

    def _encoder_transfer(self, kind: Kind, batch: int, sample: int) -> Action:
        m = self.microbatch_of[sample]
        return Action(kind, ENCODER_REGION, 0, batch, peer=self.stage_rank(self.g.microbatch_replica[m], 0),
                      key=ACT_KEY if kind is Kind.POOL_PUT else GRAD_KEY, sample=sample)

    def _backbone_transfer(self, kind: Kind, microbatch: int, sample: int) -> Action:
        return Action(kind, BACKBONE_REGION, 0, self.offset + microbatch,
                      peer=self.g.batch_replica[self.batch_of[sample]],
                      key=ACT_KEY if kind is Kind.POOL_GET else GRAD_KEY, sample=sample)

    def backbone_programs(self, semantics: str) -> dict[int, list[Action]]:
        """Each replica's 1F1B programs, renumbered into the flow plan, with stage 0's pool
        transfers around its computes."""
        gradients_back = self.kinds[ENCODER_REGION] is not None
        programs = {}
        for d in range(self.g.dp):
            local = self.g.replica_microbatches(d)
            pipeline = compose([self.backbone], len(local), semantics=semantics)
            for stage, pipeline_program in pipeline.programs.items():
                program: list[Action] = []
                for a in pipeline_program:
                    m = local[a.microbatch]
                    moved = replace(a, microbatch=self.offset + m,
                                    peer=None if a.peer is None else self.stage_rank(d, a.peer))
                    if stage == 0 and a.kind is Kind.FORWARD:
                        program += [self._backbone_transfer(Kind.POOL_GET, m, s) for s in self.pooled(m)]
                    program.append(moved)
                    if stage == 0 and a.kind is Kind.BACKWARD and gradients_back:
                        program += [self._backbone_transfer(Kind.POOL_PUT, m, s) for s in self.pooled(m)]
                programs[self.stage_rank(d, stage)] = program
        return programs

    def _gradients_ready(self, backbone: dict[int, list[Action]]) -> dict[int, tuple[int, int]]:
        """Per encoder batch, when the last gradient it needs is put: (the position of that
        microbatch's backward among its replica's stage-0 backwards, the replica)."""
        position = {}
        for d in range(self.g.dp):
            backwards = [a.microbatch - self.offset for a in backbone[self.stage_rank(d, 0)] if a.kind is Kind.BACKWARD]
            position.update((m, (k, d)) for k, m in enumerate(backwards))
        return {b: max(position[self.microbatch_of[s]] for s in ids) for b, ids in enumerate(self.g.batches)}
