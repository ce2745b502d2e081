"""Text and chart of a plan, for ``mindspeed-flow plan``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from .candidates import divisors
from .plan import COLOCATED, AllocationPlan
from .proxy import ProxyModel
from .specs import AllocatorConfig
from .upstream import megatron_args, mindspeed_mm_args, mindspeed_mm_model


def _shape(plan: AllocationPlan) -> tuple[str, str]:
    e, b = plan.encoder, plan.backbone
    encoder = "in stage 0" if plan.placement == COLOCATED else f"dp {e.dp} x tp {e.tp}"
    return encoder, f"dp {b.dp} x tp {b.tp} x pp {b.pp}, micro batch {b.micro_batch}"


def describe(plan: AllocationPlan, config: AllocatorConfig, title: str) -> str:
    """The plan as ``mindspeed-flow plan`` prints it: configs, rates, MFU, alternatives and
    the upstream arguments that realise it."""
    p = plan.predicted
    enc, bb = _shape(plan)
    budget = config.cluster.devices
    encoder_devices = 0 if plan.placement == COLOCATED else plan.encoder.devices
    lines = [
        title,
        f"placement {plan.placement}" + (": the encoder inside the backbone's stage 0, one strategy for both "
                                         "(Megatron / MindSpeed-MM layout)" if plan.placement == COLOCATED else
                                         ": the encoder on devices of its own, feeding the backbone"),
        f"encoder   {enc:<40} {encoder_devices:>6} devices  produces {p.production:10.2f} samples/s"
        f"  {p.encoder_memory_gib:6.1f} GiB/device",
        f"backbone  {bb:<40} {plan.backbone.devices:>6} devices  consumes {p.consumption:10.2f} samples/s"
        f"  {p.backbone_memory_gib:6.1f} GiB/device",
        f"          LLM layer split {list(plan.backbone.layer_split)}, {p.microbatches} microbatches per replica "
        f"and step, step {p.backbone_step_s:.2f} s, bubble {p.bubble_fraction:.1%} (schedule simulator)",
        f"predicted {p.throughput:.2f} samples/s, MFU {p.mfu:.1%}, mismatch {p.mismatch:.2f} samples/s "
        f"({p.mismatch / p.throughput:.1%}), {plan.devices} of {budget} devices",
    ]
    if plan.alternatives:
        lines += ["", "alternatives (next best backbone shapes):",
                  f"  {'#':<2} {'encoder':<16} {'backbone':<40} {'devices':>7} {'samples/s':>10} {'MFU':>6} "
                  f"{'mismatch':>9}"]
        for i, alt in enumerate(plan.alternatives, 1):
            enc, bb = _shape(alt)
            a = alt.predicted
            lines.append(f"  {i:<2} {enc:<16} {bb:<40} {alt.devices:>7} {a.throughput:>10.2f} {a.mfu:>6.1%} "
                         f"{a.mismatch:>9.2f}")
    lines += ["", "upstream arguments:",
              f"  Megatron:     {shlex.join(megatron_args(plan))}",
              f"  MindSpeed-MM: {shlex.join(mindspeed_mm_args(plan))}",
              "  MindSpeed-MM model JSON (merge into --mm-model):"]
    model = mindspeed_mm_model(plan)
    lines += [f"    {json.dumps({key: value})}" for key, value in model.items()]
    if plan.placement != COLOCATED:
        lines.append(f"  note: upstream alone runs the encoder inside stage 0, so these realise the backbone's "
                     f"{plan.backbone.devices} devices and the splits; the encoder's own {plan.encoder.devices} "
                     "devices need the decoupled runtime")
        enc, bb = plan.encoder, plan.backbone
        if enc.dp % bb.dp:
            lines.append(f"  no decoupled layout runs this plan: its {enc.dp} encoder replicas do not split over its "
                         f"{bb.dp} backbone replicas (plan with `encoder_split: true`)")
        else:
            lines.append(f"  or apply it at start-up, on {plan.devices} ranks, with the plugin's pool feature: "
                         "--use-flowtrain (or --flow-pool) --flow-allocator --flow-allocator-plan PLAN.yaml "
                         "(write it with --out); docs/decoupled.md")
    else:
        lines.append(f"  or apply it at start-up: --flow-allocator --flow-allocator-plan PLAN.yaml "
                     "(write it with --out)")
    return "\n".join(lines)


def draw_rate_match(plan: AllocationPlan, config: AllocatorConfig, proxy: ProxyModel, path: Path) -> Path:
    """Left: encoder production against encoder devices (the plan's TP, every allowed DP)
    with the plan's backbone consumption as a line; right: production and consumption of
    the plan and its alternatives."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model, workload = config.model, config.workload
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    tp = plan.encoder.tp
    units = workload.global_batch // workload.encoder_micro_batch
    dps = [d for d in divisors(units) if d * tp + plan.backbone.devices <= config.cluster.devices] or [1]
    rates = [proxy.encoder(model.encoder, workload, tp, d).rate for d in dps]
    left.plot([d * tp for d in dps], rates, "o-", label=f"decoupled encoder production (tp {tp})")
    left.axhline(plan.predicted.consumption, color="tab:red", label="backbone consumption (plan)")
    if plan.placement != COLOCATED:
        left.plot([plan.encoder.devices], [plan.predicted.production], "k*", markersize=14, label="plan")
    left.set_xscale("log", base=2)
    left.set_xlabel("encoder devices")
    left.set_ylabel("samples/s")
    left.set_title("rate match")
    left.legend()
    plans = (plan,) + plan.alternatives
    labels = ["plan"] + [f"alt {i}" for i in range(1, len(plans))]
    xs = range(len(plans))
    right.bar([x - 0.2 for x in xs], [p.predicted.production for p in plans], 0.4, label="production")
    right.bar([x + 0.2 for x in xs], [p.predicted.consumption for p in plans], 0.4, label="consumption")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("samples/s")
    right.set_title("plan and alternatives")
    right.legend()
    fig.suptitle(f"{model.name}: {plan.throughput:.1f} samples/s on {plan.devices} devices")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
