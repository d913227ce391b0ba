"""The `toolkit plan` table of one plan and the one-line labels of layouts; no logic. An
invalid plan whose sizes do not come out shows the sizes as written and its errors, and no
derived number or estimate."""
from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from ..estimate.compute import routed_share
from ..estimate.memory import peak_phase

if TYPE_CHECKING:
    from ..plan import Plan


def layout_label(plan: Plan) -> str:
    lay = plan.layout
    experts = f" ep{lay.ep} etp{lay.etp}" if plan.shape.is_moe else ""
    dp = f" dp{lay.dp}" if plan.estimated else ""
    extra = (f" {lay.cp_comm}" + (f"({lay.cp_a2a})" if lay.cp_a2a else "") if lay.cp > 1 else "")
    split = lay.split.describe() if lay.split is not None and lay.split.megatron_fields() else ""
    extra += (f" [{split}]" if split else "") + (" tp-overlap" if lay.tp_comm_overlap else "")
    extra += " ep-overlap" if lay.ep_a2a_overlap else ""
    return f"tp{lay.tp} pp{lay.pp} vpp{lay.vpp} cp{lay.cp}{experts}{dp}" + (" sp" if lay.sequence_parallel else "") + extra


def zero_label(plan: Plan) -> str:
    z = plan.spec.zero
    off = [f"{k} {v}" for k, v in (("opt", z.offload_optimizer), ("param", z.offload_param)) if v != "none"]
    return f"{z.stage}" + (f" ({', '.join(off)})" if off else "")


def plan_label(plan: Plan, sep: str = " ") -> str:
    """A layout's name: grid, then ZeRO, micro batch, recompute (``sep="\\n"``: two lines, for charts)."""
    return f"{layout_label(plan)}{sep}ZeRO-{zero_label(plan)} mbs{plan.batch.micro} rc-{plan.spec.recompute}"


def _layout(plan: Plan, lay: dict) -> str:
    experts = f" ep={lay['ep']} etp={lay['etp']}" if plan.shape.is_moe else ""
    sizes = f"tp={lay['tp']} pp={lay['pp']} vpp={lay['vpp']} cp={lay['cp']}{experts}"
    sp = f"sequence parallel {'on' if lay['sequence_parallel'] else 'off'}"
    if not plan.estimated:
        return f"{sizes} on {lay['world']} GPUs (the sizes do not come out: see the errors); {sp}"
    expert_dp = f" (expert dp={lay['edp']})" if plan.shape.is_moe else ""
    return f"{sizes} -> dp={lay['dp']}{expert_dp}, {sp}"


def _batch(plan: Plan, b: dict, dp: int | None) -> str:
    if not plan.estimated:
        return f"global {b['global']}, micro {b['micro']}, seq_len {b['seq_len']}"
    return f"global {b['global']} = micro {b['micro']} x accumulation {b['grad_accum']} x dp {dp}; " \
           f"seq_len {b['seq_len']}"


def _estimates(plan: Plan, d: dict) -> list[tuple[str, str]]:
    m, t = d["memory_gib"], d["time"]
    rows = [(f"memory / GPU (stage {m['worst_stage']})",
             f"params {m['params']:.2f} + grads {m['grads']:.2f} + optimizer {m['optimizer']:.2f} + "
             f"{peak_phase(m, '.2f')} + buffers {m['buffers']:.2f} = "
             f"[bold]{m['total']:.2f} GiB[/] of {m['gpu']:.1f} GiB ({'fits' if d['fits'] else 'DOES NOT FIT'})")]
    if m["cpu_offloaded"]:
        rows.append(("host memory / GPU", f"{m['cpu_offloaded']:.2f} GiB of offloaded model states"))
    rows.append(("model states (16 B/param)", f"{m['classic_model_states_total']:,.1f} GiB unsharded"))
    comm = ", ".join(f"{k} {v:.3f}" for k, v in t["comm_s"].items() if v)
    sec = t["seconds"]
    work = ", ".join(f"{k} {sec[k]:.3f}" for k in ("gemm", "attention", "memory", "recompute", "optimizer") if sec[k])
    rows += [("step time", f"{t['step_time_s']:.3f} s (compute {t['compute_s']:.3f} s: {work}; exposed comm: "
                           f"{comm or 'none'}; bubble {t['bubble_fraction']:.1%}; slowest stage "
                           f"{t['slowest_stage']}; dominant: {t['dominant']})"),
             ("throughput", f"{t['tokens_per_s']:,.0f} tokens/s{_fill(t['fill'])}, MFU {t['mfu']:.1%}, "
                            f"{t['model_tflops_per_step']:,.0f} TFLOP per step"),
             ("time to train", f"{t['train_tokens']:.3g} tokens in {t['time_to_train_days']:.1f} days")]
    return rows


def _fill(fill: float) -> str:
    return "" if fill == 1 else f" of conversations (data.fill: {fill:.1%} of the positions; the rest is padding)"


def _experts(plan: Plan) -> str:
    """Routing as the estimate counts it: balanced, then the capacity settings."""
    mo, m = plan.shape.moe, plan.spec.moe
    head = f"{mo.num_experts} x top-{mo.topk}, {m.token_dispatcher} dispatcher"
    if m.capacity_factor is None:
        return f"{head}, dropless (estimated at balanced routing)"
    share = routed_share(m)
    how = "padded to" if m.pad_to_capacity else "dropped above"
    return (f"{head}, capacity {m.capacity_factor:g} ({how} it): every expert computes {share:.2f} x its "
            "balanced share")


def plan_table(plan: Plan) -> Table:
    d = plan.as_dict()
    lay, b, z, mdl = d["layout"], d["batch"], d["zero"], d["model"]
    tab = Table(title=f"{plan.spec.model} on {d['cluster']['world']} x {plan.gpu.name}", show_header=False)
    tab.add_column(style="bold")
    tab.add_column()
    rows = [("model", f"{mdl['architecture']}: {mdl['params']:,} params ({mdl['active_params']:,} active), "
                      f"vocab padded to {mdl['padded_vocab']:,}"),
            ("layout", _layout(plan, lay)),
            ("batch", _batch(plan, b, lay["dp"])),
            ("zero / precision", f"ZeRO-{z['stage']}, offload optimizer={z['offload_optimizer']} "
                                 f"param={z['offload_param']}; {d['precision']}; recompute {d['recompute']}")]
    if plan.shape.moe is not None:
        rows.append(("experts", _experts(plan)))
    rows += _estimates(plan, d) if plan.estimated else []
    rows += [("[yellow]warning[/]", w) for w in d["warnings"]] + [("[red]error[/]", e) for e in d["errors"]]
    for row in rows:
        tab.add_row(*row)
    return tab
