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

from dataclasses import dataclass, replace
from typing import Sequence

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
TAKEN_KEY = ACT_KEY.of(BoundaryKind.TAKEN)


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


@dataclass(frozen=True)
class StepNumbering:
    """How :func:`compose_flow_steps` numbers several steps in one plan: step ``k``'s groups
    follow the earlier steps' (``group_offset[k]``), and its sample ``s`` is plan sample
    ``k * sample_stride + s`` (a step's ids repeat across steps).  Step 0 keeps its numbers,
    so a one-step plan is :func:`compose_flow`'s."""

    group_offset: tuple[int, ...]
    sample_stride: int

    @classmethod
    def of(cls, groupings: Sequence[FlowGrouping]) -> "StepNumbering":
        offsets, total = [], 0
        for g in groupings:
            offsets.append(total)
            total += len(g.batches) + len(g.microbatches)
        return cls(tuple(offsets), 1 + max(s.sample_id for g in groupings for s in g.samples))

    def sample(self, k: int, sample_id: int) -> int:
        return k * self.sample_stride + sample_id

    def step_of_sample(self, plan_sample: int) -> tuple[int, int]:
        """``(step index, sample id)`` of a plan sample number."""
        return divmod(plan_sample, self.sample_stride)

    def step_of_group(self, group: int) -> int:
        """The step index whose groups hold plan group ``group``."""
        return max(k for k, offset in enumerate(self.group_offset) if offset <= group)

    def label(self, action: Action) -> str:
        """``"<step index>:<group in its step>"``: a Gantt bar's text
        (:func:`mindspeed_flow.schedule.gantt.draw`'s ``text``), so a producer's bars of the
        next step stand out among the backbone's of this one."""
        k = self.step_of_group(action.microbatch)
        return f"{k}:{action.microbatch - self.group_offset[k]}"


def compose_flow_steps(
    groupings: Sequence[FlowGrouping],
    *,
    encoder_layers: int = 1,
    llm_layers: int | None = None,
    trainable_encoder: bool = True,
    max_in_flight: int | None = None,
    semantics: str = "eager",
) -> Plan:
    """Consecutive steps of a flow in one plan, so :func:`~mindspeed_flow.schedule.simulate`
    and the Gantt chart show a frozen encoder running ahead into the next step.

    Each step is :func:`compose_flow`'s, numbered by :class:`StepNumbering`; every rank runs
    its steps one after the other.  A *frozen* encoder's replica goes on into the next step's
    batches as soon as its own are done (nothing it runs waits for the backbone), bounded by
    ``max_in_flight``: before the forward of a batch whose first entry is the replica's
    ``j``-th (counted over the steps), it waits until its ``(j - max_in_flight)``-th entry was
    taken (a ``GET [vit.s0:taken]`` from the consumer, which ``PUT``s that notice right after
    its get of the entry, in the same batch of transfers: the consumer takes each entry as
    it is ready, so a window smaller than a microbatch cannot deadlock): as the runtime's
    :meth:`~.producer.EmbeddingProducer.run_ahead` stops before a batch while
    ``max_in_flight`` entries are in flight.  A *trainable* encoder's next step follows its
    backwards of this one in its program, so it stays within the step.  The encoder
    replicas' broadcast is the first step's and their gradient reduce the last step's (the
    validator wants each once); the sums and optimizer steps between steps, the backbone's
    too, are not in the plan, nor the pool's capacity (``max_in_flight`` is the bound).
    """
    groupings = list(groupings)
    if not groupings:
        raise GroupingError("compose_flow_steps: no steps")
    shape = {(g.encoder_replicas, g.dp, g.pp) for g in groupings}
    if len(shape) > 1:
        raise GroupingError(f"compose_flow_steps: the steps differ in (encoder replicas, dp, pp): {sorted(shape)}")
    if max_in_flight is not None and max_in_flight < 1:
        raise GroupingError(f"compose_flow_steps: max_in_flight must be >= 1 or None, got {max_in_flight}")
    numbering = StepNumbering.of(groupings)
    programs: dict[int, list[Action]] = {}
    paths, samples, plan = [], {}, None
    for k, g in enumerate(groupings):
        plan = compose_flow(g, encoder_layers=encoder_layers, llm_layers=llm_layers,
                            trainable_encoder=trainable_encoder, semantics=semantics)
        offset, last = numbering.group_offset[k], k == len(groupings) - 1
        for rank, program in plan.programs.items():
            programs.setdefault(rank, []).extend(
                replace(a, microbatch=None if a.microbatch is None else offset + a.microbatch,
                        sample=None if a.sample is None else numbering.sample(k, a.sample)) for a in program
                if not (a.kind is Kind.PARAM_BROADCAST and k) and not (a.kind is Kind.GRAD_REDUCE and not last))
        paths += plan.paths
        samples.update((offset + m, tuple(numbering.sample(k, s) for s in ids)) for m, ids in plan.samples.items())
    if max_in_flight is not None:
        _in_flight_window(programs, groupings[0].encoder_replicas, max_in_flight)
    return Plan(regions=plan.regions, num_microbatches=len(paths),
                programs={rank: tuple(programs[rank]) for rank in sorted(programs)}, paths=tuple(paths),
                roles=plan.roles, semantics=semantics, samples=samples)


def _in_flight_window(programs: dict[int, list[Action]], encoders: int, window: int) -> None:
    """Bound every encoder replica's entries in flight by ``window`` (see
    :func:`compose_flow_steps`): a wait before each batch forward, a taken notice from the
    consumer right after its get of the awaited entry."""
    notices: dict[int, list[Action]] = {}  # consumer rank -> its notices (by sample)
    for e in range(encoders):
        puts = [a for a in programs[e] if a.kind is Kind.POOL_PUT and a.carries is BoundaryKind.ACT]
        entry = {a.sample: j for j, a in enumerate(puts)}
        program: list[Action] = []
        for i, a in enumerate(programs[e]):
            if a.kind is Kind.FORWARD:
                first = next(b for b in programs[e][i + 1:] if b.kind is Kind.POOL_PUT)
                j = entry[first.sample] - window
                if j >= 0:
                    awaited = puts[j]
                    program.append(Action(Kind.POOL_GET, ENCODER_REGION, 0, awaited.microbatch, peer=awaited.peer,
                                          key=TAKEN_KEY, sample=awaited.sample))
                    notices.setdefault(awaited.peer, []).append(
                        Action(Kind.POOL_PUT, BACKBONE_REGION, 0, None, peer=e, key=TAKEN_KEY, sample=awaited.sample))
            program.append(a)
        programs[e] = program
    for rank, pending in notices.items():
        by_sample = {n.sample: n for n in pending}
        program = []
        for a in programs[rank]:
            program.append(a)
            if a.kind is Kind.POOL_GET and a.carries is BoundaryKind.ACT and a.sample in by_sample:
                program.append(replace(by_sample.pop(a.sample), microbatch=a.microbatch))
        programs[rank] = program


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
