"""The calibrated step-time model's effect, pinned as rankings of fixed layout pairs (never as
timings): each pair is one the constants of toolkit.estimate.compute.CALIBRATION, the overlap model
or the per-stage pipeline decides, and a change that flips one must say why."""
import pytest

from toolkit.plan import make_plan
from toolkit.spec import TrainingSpec


def _spec(model: str, nodes: int, seq: int, gbs: int, **parallel) -> dict:
    return {"model": model, "target": "megatron-lm", "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": "h100-80gb"},
            "parallel": parallel, "zero": {"stage": 1}, "recompute": "none", "batch": {"micro": 1, "global": gbs,
                                                                                       "seq_len": seq}}


SEED = _spec("llama3-70b", 128, 4096, 2048)  # the seeds' 1024-GPU job
TITAN = _spec("llama3-70b", 32, 8192, 512)  # torchtitan's 256-GPU job
DGXC70 = _spec("llama3.1-70b", 8, 8192, 128, tp=4, pp=4, vpp=5, cp=2, sequence_parallel=True)
L8B = _spec("llama3.1-8b", 1, 8192, 128)
A100_2022 = {**_spec("llama3-70b", 16, 2048, 512, tp=8, pp=16, sequence_parallel=False), "recompute": "full",
             "cluster": {"nodes": 16, "gpus_per_node": 8, "gpu": "a100-80gb"}}  # as Korthikanti et al. ran: dp 1, TP8
MIXTRAL = _spec("mixtral-8x7b", 8, 4096, 512, tp=1, pp=4, vpp=8, ep=8)  # the NeMo recipe's layout
L405_LONG = _spec("llama3.1-405b", 2048, 131072, 128, tp=8, pp=16, vpp=8, cp=16, sequence_parallel=True,
                  embedding_in_split=True, loss_in_split=True)

# (base spec, faster layout, slower layout, what decides it)
PAIRS = {
    "seq 4096: cp=1 beats the old cp=4 pick": (
        SEED, {"parallel.tp": 4, "parallel.pp": 4, "parallel.vpp": 20, "parallel.sequence_parallel": True,
               "batch.micro": 2},
        {"parallel.tp": 2, "parallel.pp": 8, "parallel.vpp": 2, "parallel.cp": 4, "parallel.sequence_parallel": True},
        "GEMMs on 1,024-token shards and 512-token attention chunks lose efficiency; dp over dp x cp costs more"),
    "seq 4096: the same grid without cp": (
        SEED, {"parallel.tp": 4, "parallel.pp": 4, "parallel.vpp": 20, "parallel.sequence_parallel": True,
               "batch.micro": 2},
        {"parallel.tp": 4, "parallel.pp": 4, "parallel.vpp": 20, "parallel.cp": 2, "parallel.sequence_parallel": True,
         "batch.micro": 2}, "the tile and attention-chunk constants"),
    "seq 8192 on 256 GPUs: tp4 pp4 beats the old tp1 pp8 cp8 pick": (
        TITAN, {"parallel.tp": 4, "parallel.pp": 4, "parallel.vpp": 20, "parallel.sequence_parallel": True},
        {"parallel.tp": 1, "parallel.pp": 8, "parallel.vpp": 2, "parallel.cp": 8}, "as above, at cp=8"),
    "TE userbuffer overlap hides tp communication": (
        DGXC70, {"parallel.tp_comm_overlap": True}, {}, "the tp overlap model"),
    "interleaving shrinks the bubble": (DGXC70, {}, {"parallel.vpp": 1}, "the per-stage pipeline"),
    "DGXC's tp1 cp2 for 8B beats tp2": (
        L8B, {"parallel.cp": 2}, {"parallel.tp": 2, "parallel.sequence_parallel": True},
        "tp-split GEMMs and exposed tp forward communication against cp's 4,096-token shards"),
    "512-token chunks: a2a (whole-sequence attention) beats the p2p ring": (
        {**L8B, "batch": {"micro": 1, "global": 32, "seq_len": 4096}}, {"parallel.cp": 8, "parallel.cp_comm": "a2a"},
        {"parallel.cp": 8}, "the attention-chunk constant against the all-to-all's exposed traffic"),
    "no cp beats either at 4,096 tokens": (
        {**L8B, "batch": {"micro": 1, "global": 32, "seq_len": 4096}}, {}, {"parallel.cp": 8, "parallel.cp_comm": "a2a"},
        "the all-to-all and the smaller GEMMs"),
    "Megatron-LM 2021-2023: pipeline sends split over tp (scatter/gather) without sequence parallel": (
        A100_2022, {"estimate.pp_scatter_gather": True}, {}, "1/tp of each activation crosses InfiniBand"),
    "with scatter/gather sends, sequence parallel still beats tp alone": (
        A100_2022, {"parallel.sequence_parallel": True, "estimate.pp_scatter_gather": True},
        {"estimate.pp_scatter_gather": True}, "sp's smaller elementwise work and the same pipeline sends"),
    "overlapped pipeline sends: interleaving 5 chunks shrinks the bubble at no send cost": (
        A100_2022, {"parallel.vpp": 5}, {}, "the interleaved schedule's sends hidden behind the next chunk"),
    "Megatron-LM before May 2023 waits for each pipeline send: 5 chunks send 5 times as much": (
        {**A100_2022, "estimate": {"pp_overlap": False}}, {}, {"parallel.vpp": 5},
        "2 vpp exposed sends per micro-batch against a bubble already small at 512 micro-batches"),
    "megatron's EP all-to-all overlap hides the dispatch and combine": (
        MIXTRAL, {"moe.a2a_overlap": True}, {}, "the ep overlap model (combined 1F1B)"),
    # megatron-core's MoE README (c230e0d): "In practice, EP8TP1 is better than EP4TP2 for 8x7B"
    "Mixtral 8x7B: EP8 TP1 beats EP4 TP2": (
        MIXTRAL, {}, {"parallel.tp": 2, "parallel.ep": 4, "parallel.etp": 2, "parallel.sequence_parallel": True},
        "expert GEMMs split over etp and its all-reduces cost more than the larger EP all-to-all in a node"),
    "131,072 tokens: the p2p ring hides what all_gather exposes": (
        L405_LONG, {"parallel.cp_comm": "p2p"}, {"parallel.cp_comm": "all_gather"}, "the cp overlap model"),
}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_layout_pair_ranks(name):
    base, fast, slow, why = PAIRS[name]
    spec = TrainingSpec.from_dict(base)
    a, b = make_plan(spec.with_overrides(fast)), make_plan(spec.with_overrides(slow))
    assert a.time is not None and b.time is not None
    assert a.time.step_time_s < b.time.step_time_s, (name, why, a.time.seconds, b.time.seconds)
