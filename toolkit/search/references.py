"""Published training runs, as specs, with the throughput each source publishes (verified at the
source named in ``source``; docs/planner.md lists them with their URLs).

``tokens_per_gpu`` is tokens/s/GPU: from the published step time where there is one, else
converted from the published per-GPU FLOP/s with the FLOP count named in ``note``.
``comparable``: our estimate measures the same thing (bf16/fp16 on the registry GPU the run
used); FP8 runs and torchtitan's 500 W HBM2e H100s are shown but not compared. ``fit``: the
step-time constants (compute.CALIBRATION) are fitted on these rows only (each source's headline
rows: DGXC's 8B/70B/405B, Narayanan et al.'s Table 1, Korthikanti et al.'s selective-recompute
rows); the others are held out. Rows run on Megatron-LM between Feb 2021 and Mar 2023 without
sequence parallelism set estimate.pp_scatter_gather (that code's pipeline sends), and all of
them ran before Megatron-LM overlapped pipeline sends (overlap_p2p_comm, May 2023):
estimate.pp_overlap false; Narayanan et al.'s ran before its Float16 optimizer freed the fp32
copies of fp16 gradients between steps (July 2021): estimate.grad_copy_freed false. GPT models
(LayerNorm, GeLU 4h MLP, MHA) are given as LLaMA-shaped stand-ins with an MLP of 8h/3 (rounded
to a multiple of 8) and as many key-value heads as heads: the same GEMM FLOPs and parameters.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ..models import ModelShape, load_model


@dataclass(frozen=True)
class Published:
    name: str
    spec: dict
    source: str
    tokens_per_gpu: float | None = None  # published tokens/s/GPU
    comparable: bool = False  # does our estimate measure the same run (precision, hardware)?
    note: str = ""
    shape: Callable[[], ModelShape] | None = None  # a model the registry does not name
    fit: bool = False  # the calibration is fitted on this row
    published_mfu: str = ""  # as the source states it (its own FLOP count)
    tflops_per_gpu: float | None = None  # published model FLOP/s per GPU, converted with our FLOP count
    software: Software | None = None  # what the source's software offered: a second, restricted search


@dataclass(frozen=True)
class Software:
    """The choices the software a reference ran offered (or its job fixed), as search axes (zero:
    ZeRO stages, no offload); the published layout is also ranked among these."""

    name: str
    axes: dict[str, tuple]
    why: str


def _spec(model: str, nodes: int, parallel: dict, *, seq: int, gbs: int, micro: int = 1, zero: int = 1,
          recompute: str = "none", gpu: str = "h100-80gb", precision: str = "bf16", attention: str = "auto",
          target: str = "megatron-lm", megatron_2021_22: bool = False, mtp: int | None = None,
          grads: str | None = None, grad_copy_kept: bool = False, moe: dict | None = None) -> dict:
    """A reference's spec; ``megatron_2021_22``: run on Megatron-LM of 2021-2022, whose pipeline
    sends split over tp (estimate.pp_scatter_gather) and are waited for (estimate.pp_overlap
    false: overlap_p2p_comm came in May 2023); ``grad_copy_kept``: on Megatron-LM before July 2021,
    whose fp32 copies of 16-bit gradients stayed between steps (estimate.grad_copy_freed false)."""
    estimate = {**({"pp_scatter_gather": True, "pp_overlap": False} if megatron_2021_22 else {}),
                **({"grad_copy_freed": False} if grad_copy_kept else {})}
    return {"model": model, "target": target, "cluster": {"nodes": nodes, "gpus_per_node": 8, "gpu": gpu},
            "parallel": parallel, "zero": {"stage": zero}, "recompute": recompute, "precision": precision,
            **({"optimizer": {"grad_reduce_dtype": grads}} if grads else {}),
            "attention": {"backend": attention}, "batch": {"micro": micro, "global": gbs, "seq_len": seq},
            **({"estimate": estimate} if estimate else {}),
            **({"mtp": {"layers": mtp}} if mtp is not None else {}), **({"moe": moe} if moe else {})}


def gpt(hidden: int, layers: int, heads: int) -> Callable[[], ModelShape]:
    """A GPT-3-style model (vocab 51,200, seq 2,048) as a LLaMA-shaped stand-in."""
    def build() -> ModelShape:
        ffn = round(8 * hidden / 3 / 8) * 8
        return ModelShape("LlamaForCausalLM", vocab_size=51200, hidden_size=hidden, num_layers=layers,
                          num_attention_heads=heads, num_query_groups=heads, head_dim=hidden // heads,
                          ffn_hidden_size=ffn, max_position_embeddings=2048, rope_theta=10000.0, norm_eps=1e-5)
    return build


def _llama405_16_groups() -> ModelShape:
    return replace(load_model("llama3.1-405b"), num_query_groups=16)


DGXC = "NVIDIA/dgxc-benchmarking"
DGXC_LLAMA = (f"{DGXC} llama3.1/README_{{size}}.md (NeMo 24.09 BF16): {{layout}}; step {{step}} s, {{tps}} tokens/s; "
              "NeMo-Framework-Launcher launcher_scripts/conf/training/llama/llama3_1_{size}.yaml: {{cfg}}")
UB = "no recompute, TE tp-comm overlap (ub_tp_comm_overlap), overlapped grad/param sync and p2p"
DGXC_70B = ("NVIDIA/dgxc-benchmarking llama3.1/README_70b.md: NeMo 24.09 BF16, TP4 PP4 CP2 VP5 MBS1 GA64, "
            "64 H100 GBS 128: 71,235 tokens/s (14.72 s/step), i.e. 1,113 tokens/s/GPU")
DSV3 = (f"{DGXC} deepseek_v3/pretraining/README.md (NeMo 25.04.01 BF16, H100): TP2 PP{{pp}} EP64 ETP1 VP1 MBS1 GBS "
        "{gbs}, seq 4096: {step} s/step, {tps} tokens/s; launch.sh: recompute_modules mla_up_proj; NeMo "
        "scripts/performance/llm/pretrain_deepseek_v3.py: first stage 64/pp - 1 layers, last 64/pp - 2, token drop "
        "(MegatronTokenDropCallback, nemo/lightning/pytorch/callbacks/moe_token_drop.py: moe_expert_capacity_factor "
        "1.0, moe_pad_expert_input_to_capacity)")
TOKEN_DROP = {"capacity_factor": 1.0, "pad_to_capacity": True}  # NeMo's and Megatron-Bridge's "token drop"
NEMO_25_04 = Software(
    "NeMo 25.04.01, TransformerEngine before 2.5", {"cp": (1,)},
    "no context parallelism with MLA: before 2.5, TransformerEngine's get_attention_backend drops FusedAttention "
    "under cp > 1 when the q/k and v head sizes differ (192 and 128 here), FlashAttention for MLA, and its unfused "
    "attention has no cp (transformer_engine/pytorch/attention/dot_product_attention/utils.py at v2.3 and v2.4). "
    "Support came with TE commit faee0e8 (PR #1729, merged 2025-06-11), after the DGXC release (v25.05, "
    "2025-06-10) that published these runs on the nemo:25.04.01 container; megatron-core's MoE README: 'Enable CP "
    "for MLA and DeepSeek-V3, requires TransformerEngine >= 2.5.0'")

MEASURED = (
    # -------------------------------------------------------------- NVIDIA DGX Cloud benchmarks (H100, BF16)
    Published("Llama-3.1-8B, 8 H100 BF16 (DGXC, NeMo 24.09)",
              _spec("llama3.1-8b", 1, {"tp": 1, "cp": 2}, seq=8192, gbs=128),
              f"{DGXC} llama3.1/README_8b.md: TP1 PP1 CP2 MBS1 GA32, 8 H100 GBS 128: 12.91 s/step, 81,222 tokens/s; "
              "NeMo-Framework-Launcher llama3_1_8b.yaml: no recompute, no sequence parallel",
              81222 / 8, True, fit=True, published_mfu="59.4% (non-causal attention FLOPs)"),
    Published("Llama-3.1-70B, 64 H100 BF16 (DGXC, NeMo 24.09)",
              _spec("llama3.1-70b", 8, {"tp": 4, "pp": 4, "vpp": 5, "cp": 2, "sequence_parallel": True,
                                         "tp_comm_overlap": True}, seq=8192, gbs=128),
              DGXC_70B + "; NeMo-Framework-Launcher llama3_1_70b.yaml: " + UB, 71235 / 64, True, fit=True,
              published_mfu="54.1% (non-causal)"),
    Published("Llama-3.1-70B, 1024 H100 BF16 (DGXC, NeMo 24.09)",
              _spec("llama3.1-70b", 128, {"tp": 4, "pp": 4, "vpp": 5, "cp": 2, "sequence_parallel": True,
                                           "tp_comm_overlap": True}, seq=8192, gbs=2048),
              f"{DGXC} llama3.1/README_70b.md: the same layout on 1024 H100, GBS 2048: 14.92 s/step, "
              "1,124,478 tokens/s", 1124478 / 1024, True, published_mfu="53.4% (non-causal)"),
    Published("Llama-3.1-405B, 576 H100 BF16 (DGXC, NeMo 24.09)",
              _spec("llama3.1-405b", 72, {"tp": 8, "pp": 9, "vpp": 7, "cp": 2, "sequence_parallel": True,
                                           "tp_comm_overlap": True}, seq=8192, gbs=252),
              f"{DGXC} llama3.1/README_405b.md: TP8 PP9 CP2 VP7 MBS1, 576 H100 GBS 252: 17.20 s/step, 120,022 "
              "tokens/s; its config and FLOP count use 16 query groups (the model is built so here); "
              "llama3_1_405b.yaml: " + UB, 120022 / 576, True, shape=_llama405_16_groups, fit=True,
              published_mfu="55.8% (non-causal)"),
    Published("DeepSeek-V3, 1024 H100 BF16 (DGXC, NeMo 25.04)",
              _spec("deepseek-v3", 128, {"tp": 2, "pp": 16, "ep": 64, "etp": 1, "sequence_parallel": True,
                                          "first_stage_layers": 3, "last_stage_layers": 2}, seq=4096, gbs=8192,
                    recompute="selective", mtp=1, grads="bf16", moe=TOKEN_DROP),
              DSV3.format(pp=16, gbs=8192, step=52.04, tps="644,781.55"), 644781.55 / 1024, True,
              "one MTP module (NeMo v2.3.0's deepseek_v3.pretrain_recipe, which the script calls, has use_mtp=True: "
              "mtp_num_layers 1); every expert computes its capacity (1.0 x its balanced share: the balanced load "
              "the model assumes); megatron's mla_up_proj recompute is estimated as "
              "selective (attention core)", published_mfu="16.55% (163.7 TFLOP/s/GPU, NeMo's count)",
              software=NEMO_25_04),
    Published("DeepSeek-V3, 512 H100 BF16 (DGXC, NeMo 25.04)",
              _spec("deepseek-v3", 64, {"tp": 2, "pp": 8, "ep": 64, "etp": 1, "sequence_parallel": True,
                                         "first_stage_layers": 7, "last_stage_layers": 6}, seq=4096, gbs=4096,
                    recompute="selective", mtp=1, grads="bf16", moe=TOKEN_DROP),
              DSV3.format(pp=8, gbs=4096, step=48.948, tps="342,755.90"), 342755.90 / 512, True,
              "as the 1024-GPU row", published_mfu="17.60% (174.02 TFLOP/s/GPU)", software=NEMO_25_04),
    # -------------------------------------------------------------- megatron-core's MoE README (H100, BF16)
    Published("Mixtral-8x7B, 64 H100 BF16 (megatron-core MoE README, MCore v0.9)",
              _spec("mixtral-8x7b", 8, {"tp": 1, "pp": 4, "vpp": 8, "ep": 8}, seq=4096, gbs=256,
                    moe={"token_dispatcher": "alltoall"}),
              "NVIDIA/Megatron-LM megatron/core/transformer/moe/README.md at c230e0d (2024-11-21, 'Update MoE Doc'): "
              "'This boosts Mixtral 8X7B bf16 training to achieve 468 TFLOPS as of MCore v0.9'; its 'Reference Best "
              "Parallel Mapping': Mixtral 8x7B (Dropless), All-to-All, BF16, 64 GPUs, seq 4096, TP1 EP8 PP4 VP8 MBS1 "
              "GBS 256; 8xH100 80GB HBM3, NVLink 4, InfiniBand 8x400 Gbit/s, PyTorch 24.09 with TE 1.11 (the commit "
              "changed the number from MCore v0.8's 438 TFLOPS and the image from PyTorch 24.04 together)", None, True,
              "tokens/s/GPU = 468 TFLOP/s / our model FLOPs per token (Megatron-LM's count to 1.00008); the "
              "README names the mapping 'of MCore v0.8' and the number 'as of MCore v0.9'; dropless, estimated "
              "with the balanced load; recompute not stated (none: the layout fits without it)",
              published_mfu="47.3% of 989 TFLOP/s", tflops_per_gpu=468e12),
    # -------------------------------------------------------------- Llama 3 paper, Table 4 (H100 80GB, 400 Gb/s RoCE)
    Published("Llama-3.1-405B, 8192 H100 (Llama 3 paper, Table 4)",
              _spec("llama3.1-405b", 1024, {"tp": 8, "pp": 16, "vpp": 8, "sequence_parallel": True,
                                             "embedding_in_split": True, "loss_in_split": True},
                    seq=8192, gbs=2048),
              "Llama Team, The Llama 3 Herd of Models, arXiv 2407.21783 v3, Table 4: 8,192 GPUs, TP8 CP1 PP16 DP64, "
              "seq 8,192, batch 32 per DP group, 430 TFLOP/s/GPU, 43% BF16 MFU; Section 3.3.2: one transformer "
              "layer fewer on the first and the last stage (embedding and output/loss as layers), interleaved "
              "schedule, no activation checkpointing", None, True,
              "tokens/s/GPU = 430 TFLOP/s / our model FLOPs per token; V is not published, but their first chunk "
              "holding only the embedding means one layer per chunk: 128 / 16 = 8 per stage, vpp 8 (megatron-core "
              "builds such a chunk without transformer layers)", published_mfu="43%", tflops_per_gpu=430e12),
    Published("Llama-3.1-405B, 16384 H100, seq 131072 (Llama 3 paper, Table 4)",
              _spec("llama3.1-405b", 2048, {"tp": 8, "pp": 16, "vpp": 8, "cp": 16, "cp_comm": "all_gather",
                                             "sequence_parallel": True, "embedding_in_split": True,
                                             "loss_in_split": True}, seq=131072, gbs=128),
              "arXiv 2407.21783 Table 4: 16,384 GPUs, TP8 CP16 PP16 DP8, seq 131,072, batch 16 per DP group, "
              "380 TFLOP/s/GPU, 38% MFU; Section 3.3.2: all-gather based context parallelism", None, True,
              "tokens/s/GPU from 380 TFLOP/s as above; vpp 8 as above", published_mfu="38%", tflops_per_gpu=380e12),
)


MEGATRON_2021 = Software(
    "Megatron-LM of April 2021", {"recompute": ("full",), "sp": (False,), "cp": (1,), "zero": (0,)},
    "full activation checkpointing only (selective recompute and sequence parallelism came with Korthikanti et "
    "al. 2022), no distributed optimizer, no context parallelism")
MAY_2022 = ("no distributed optimizer (Megatron-LM's sequence_parallel branch, merged into main 2022-05-20..25, "
            "had none: the distributed optimizer came with MR !408, merged 2022-06-08, after the paper's v1 of "
            "2022-05-10), no context parallelism")
MEGATRON_2022 = Software("Megatron-LM of May 2022", {"cp": (1,), "zero": (0,)},
                         "sequence parallelism and selective recompute; " + MAY_2022)
FULL_RECOMPUTE_2022 = Software(
    "full recompute, Megatron-LM of May 2022", {"recompute": ("full",), "cp": (1,), "zero": (0,)},
    "the row's job is full recompute (the table's baseline against selective recompute); " + MAY_2022)


def _narayanan(size: str, hidden: int, layers: int, heads: int, tp: int, pp: int, vpp: int, micro: int, gbs: int,
               gpus: int, tflops: float, pct: str) -> Published:
    """Narayanan et al. 2021 Table 1 (Megatron-LM README's table of April 2021, the same numbers), run by
    Megatron-LM's examples/sc21/run_table_1.sh: fp16, full recompute, no sequence parallel, vocab 51,200,
    seq 2,048, on A100 80GB (Selene). Their teraFLOP/s count the recomputed forward: 96 B s l h^2
    (1 + s/6h + V/16lh) per step."""
    seq, vocab = 2048, 51200
    per_token = 96 * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    par = {"tp": tp, "pp": pp, "vpp": vpp, "sequence_parallel": False}
    return Published(f"GPT-{size}, {gpus} A100 (Narayanan et al. 2021, Table 1)",
                     _spec(f"gpt-{size.lower()}", gpus // 8, par, seq=seq, gbs=gbs, micro=micro, zero=0,
                           recompute="full", gpu="a100-80gb", precision="fp16", attention="unfused",
                           megatron_2021_22=True, grad_copy_kept=True),
                     "arXiv 2104.04473 Table 1 = NVIDIA/Megatron-LM README images/cases_april2021.png (commit "
                     f"50a4b5f): {tflops:.0f} teraFLOP/s/GPU ({pct} of peak); layout from examples/sc21/"
                     f"run_table_1.sh: TP{tp} PP{pp} MBS{micro} GBS{gbs}" + (f", {layers // pp // vpp} layers per "
                                                                           "virtual stage" if vpp > 1 else ""),
                     tflops * 1e12 / per_token, True, "tokens/s/GPU = teraFLOP/s / 96 s l h^2 (1 + s/6h + V/16lh) "
                     "per sequence", gpt(hidden, layers, heads), fit=True, published_mfu=f"{pct} (hardware FLOPs)",
                     software=MEGATRON_2021)


def _korthikanti(size: str, hidden: int, layers: int, heads: int, pp: int, gpus: int, step: float, mfu: str,
                 full: bool) -> Published:  # mfu "": the issue quotes none for the full-recompute rows
    """Korthikanti et al. 2022 Table 5 (TP8, dp 1, batch = GPUs, micro 1, seq 2,048, A100 80GB); the
    selective-recompute rows are fitted on, the full-recompute baseline held out."""
    par = {"tp": 8, "pp": pp, "sequence_parallel": not full}
    kind = "full recompute" if full else "sequence parallel + selective recompute"
    return Published(f"GPT-{size}, {gpus} A100, {kind} (Korthikanti et al. 2022)",
                     _spec(f"gpt-{size.lower()}", gpus // 8, par, seq=2048, gbs=gpus if pp > 1 else 4,
                           zero=0, recompute="full" if full else "selective", gpu="a100-80gb",
                           attention="unfused", megatron_2021_22=True),
                     f"arXiv 2205.05198 Table 5 as quoted in issue 17: {step} s/iteration" + (f", MFU {mfu}" if mfu else "")
                     + "; the MFUs of the "
                     "selective rows are the NVIDIA/Megatron-LM README's table (data-parallel size 1); TP8 with PP "
                     "1/8/35/64 and batch = GPUs (22B: 4) reproduce the quoted MFUs from the quoted times",
                     (gpus if pp > 1 else 4) * 2048 / step / gpus, True, "the paper's text was not reachable here: "
                     "times and layouts are the issue's quote", gpt(hidden, layers, heads), published_mfu=mfu,
                     fit=not full, software=FULL_RECOMPUTE_2022 if full else MEGATRON_2022)


GPT_SIZES = {"1.7B": (2304, 24, 24), "3.6B": (3072, 30, 32), "7.5B": (4096, 36, 32), "18B": (6144, 40, 48),
             "39B": (8192, 48, 64), "76B": (10240, 60, 80), "145B": (12288, 80, 96), "310B": (16384, 96, 128),
             "530B": (20480, 105, 128), "1T": (25600, 128, 160), "22B": (6144, 48, 64), "175B": (12288, 96, 96)}

NARAYANAN = tuple(_narayanan(size, *GPT_SIZES[size], *rest) for size, *rest in (
    ("1.7B", 1, 1, 1, 16, 512, 32, 137, "44%"), ("3.6B", 2, 1, 1, 16, 512, 64, 138, "44%"),
    ("7.5B", 4, 1, 1, 16, 512, 128, 142, "46%"), ("18B", 8, 1, 1, 8, 1024, 256, 135, "43%"),
    ("39B", 8, 2, 1, 4, 1536, 512, 138, "44%"), ("76B", 8, 4, 3, 2, 1792, 1024, 140, "45%"),
    ("145B", 8, 8, 2, 2, 2304, 1536, 148, "47%"), ("310B", 8, 16, 2, 1, 2160, 1920, 155, "50%"),
    ("530B", 8, 35, 3, 1, 2520, 2520, 163, "52%"), ("1T", 8, 64, 1, 1, 3072, 3072, 163, "52%")))

KORTHIKANTI = tuple(_korthikanti(size, *GPT_SIZES[size], pp, gpus, step, mfu, full)
                    for size, pp, gpus, sel, full_step, mfu_sel in (
                        ("22B", 1, 8, 1.10, 1.42, "41.5%"), ("175B", 8, 64, 13.75, 18.13, "51.4%"),
                        ("530B", 35, 280, 37.83, 49.05, "56.0%"), ("1T", 64, 512, 71.49, 94.42, "56.3%"))
                    for full, step, mfu in ((False, sel, mfu_sel), (True, full_step, "")))

OTHER = (
    Published("Llama-3-70B, 32 H100 (Megatron-Bridge llama3_70b pretrain recipe)",
              _spec("llama3-70b", 4, {"tp": 4, "pp": 4, "vpp": 5, "cp": 2, "sequence_parallel": True},
                    seq=8192, gbs=512),
              "Megatron-Bridge recipes/llama/llama3_70b.py (TP4 PP4 VP5 CP2 SP, seq 8192, GBS 512, MBS 1, "
              "distributed optimizer, no recompute); no throughput published for 32 GPUs: the figure is "
              "the same per-GPU layout on 64 GPUs, " + DGXC_70B, 1113.0, False,
              "32 GPUs give dp=1 and 512 micro-batches per step, the 64-GPU run dp=2 and 64; its TE tp-comm "
              "overlap is not set here (the recipe's spec as the toolkit writes it)"),
    Published("Llama-3-70B, 64 H100 FP8 (Megatron-Bridge performance summary)",
              _spec("llama3-70b", 8, {"tp": 4, "pp": 8, "vpp": 5, "sequence_parallel": True}, seq=8192, gbs=128),
              "Megatron-Bridge docs/performance-summary.md, 25.11, DGX-H100 FP8-CS: TP4 PP8 VP5, GBS 128, MBS 1, "
              "seq 8192: 1,602 tokens/s/GPU, 719 model TFLOP/s/GPU", 1602.0, False,
              "FP8 run; we estimate bf16 (FP8 is not modelled)"),
    Published("Llama-3-70B, 256 H100 (torchtitan, FSDP32 x TP8)",
              _spec("llama3-70b", 32, {"tp": 8, "sequence_parallel": True}, seq=8192, gbs=512, micro=16, zero=3,
                    recompute="full", target="recipes"),
              "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 4: FSDP 32 x TP 8, local "
              "batch 16, GBS 512, full activation checkpointing, torch.compile + Float8: 829 tokens/s/GPU, "
              "71.9 GiB", 829.0, False, "Float8 on 96 GB HBM2e H100s at 500 W; we estimate bf16 on h100-80gb; FSDP as "
              "DeepSpeed ZeRO-3 (target recipes: this toolkit's DeepSpeed runtime; Megatron-LM's flags run ZeRO-1)"),
    Published("Llama-3-70B, 256 H100, seq 8192: the old planner's pick (issue 17)",
              _spec("llama3-70b", 32, {"tp": 1, "pp": 8, "vpp": 2, "cp": 8}, seq=8192, gbs=512),
              "issue 17: toolkit plan --auto proposed TP1 PP8 CP8 for torchtitan's Llama-3-70B job (256 H100, seq "
              "8192, GBS 512) with the one-efficiency model; searched here for Megatron-LM"),
    Published("Llama-3.1-8B, 8 H100 (torchtitan, FSDP, bf16)",
              _spec("llama3.1-8b", 1, {"tp": 1}, seq=8192, gbs=16, micro=2, zero=3, recompute="selective",
                    target="recipes"),
              "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1: FSDP on 8 GPUs, local "
              "batch 2, GBS 16, selective activation checkpointing, bf16, no torch.compile: 5,762 tokens/s/GPU",
              5762.0, False, "96 GB HBM2e H100s at 500 W (their peak is below the SXM figure our h100-80gb uses); "
              "torchtitan's per-op selective checkpointing is not megatron's"),
    Published("Qwen3-30B-A3B, 8 H100 (Megatron-Bridge qwen3_30b_a3b pretrain recipe)",
              _spec("qwen3-30b-a3b", 1, {"tp": 4, "pp": 2, "ep": 4, "etp": 1, "sequence_parallel": True},
                    seq=4096, gbs=32, micro=2, recompute="full"),
              "Megatron-Bridge recipes/qwen/qwen3_moe.py (TP4 PP2 EP4 ETP1 SP, full recompute) with "
              "recipes/common.py _pretrain_common batch defaults (GBS 32, MBS 2, seq 4096); no throughput published"),
    Published("Mixtral-8x7B, 64 H100 (NeMo 2 recipe)",
              _spec("mixtral-8x7b", 8, {"tp": 1, "pp": 4, "vpp": 8, "ep": 8}, seq=4096, gbs=512,
                    recompute="selective"),
              "NeMo 2 nemo/collections/llm/recipes/mixtral_8x7b.py performance layout (TP1 PP4 VPP8 EP8, "
              "GBS 512; its SP flag is a no-op at TP1) = examples/mixtral8x7b_ep.yaml; no throughput published"),
    Published("DeepSeek-V3, 1024 H100 (Megatron-Bridge recipe)",
              _spec("deepseek-v3", 128, {"tp": 2, "pp": 16, "ep": 64, "etp": 1, "sequence_parallel": True,
                                          "first_stage_layers": 4, "last_stage_layers": 1},
                    seq=4096, gbs=4096, recompute="selective", mtp=1),
              "NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/recipes/deepseek/deepseek_v3.py: TP2 PP16 EP64, "
              "ETP1, SP, GBS 4096, MBS 1, seq 4096, selective recompute, layout (pp16, vp1) = embedding + 4 "
              "layers | 4 x 14 | 1 layer + MTP + loss; no throughput published", None, False,
              "one MTP module on the last stage"),
    Published("LLaMA-70B (seed), 1024 H100",
              _spec("llama3-70b", 128, {"tp": 8, "pp": 8, "sequence_parallel": True}, seq=4096, gbs=2048,
                    recompute="selective"),
              "seed document (TP8 PP8 DP16, MBS 1, GBS 2048) = examples/llama70b_1024gpu.yaml; no throughput"),
)

PUBLISHED = MEASURED + NARAYANAN + KORTHIKANTI + OTHER
