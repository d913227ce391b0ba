"""The training spec: ONE description of a run, validated when it is built.

Every section rejects unknown keys with the closest valid one named
(``unknown key 'parallel.tpp' (did you mean 'tp'?)``). Values are checked for type and
range here; rules that relate several values (divisibility, batch arithmetic, memory)
live in toolkit.plan, which reports all of them at once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import MissingInputError, SpecError, unknown_key_message

Offload = Literal["none", "cpu", "nvme"]


class Section(BaseModel):
    """Frozen, strict: unknown keys are errors naming the closest valid key."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            for key in data:
                if key not in valid:
                    raise ValueError(unknown_key_message(str(key), valid))
        return data


class Cluster(Section):
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    gpu: str = "h100-80gb"  # a name from toolkit.hardware.GPUS

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


class Parallel(Section):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1, description="virtual pipeline chunks per pipeline rank (interleaved 1F1B)")
    ep: int = Field(1, ge=1)
    etp: int | None = Field(None, ge=1, description="expert tensor parallel size; null = tp")
    cp: int = Field(1, ge=1)
    cp_comm: Literal["p2p", "all_gather", "a2a", "a2a+p2p"] = Field(
        "p2p", description="context-parallel attention: p2p ring, all_gather of K/V, a2a over heads (Ulysses), "
                           "or a2a within groups of cp_a2a ranks and the ring across them (megatron's cp_comm_type)")
    cp_a2a: int | None = Field(None, ge=1, description="cp_comm a2a+p2p: ranks of the all-to-all level; the ring "
                                                       "spans cp / cp_a2a (megatron's hierarchical_context_parallel_sizes)")
    sequence_parallel: bool | None = Field(None, description="null = on when tp > 1")
    tp_comm_overlap: bool = Field(False, description="TransformerEngine's userbuffer overlap of the tensor-parallel "
                                                     "all-gathers/reduce-scatters with the GEMMs (megatron's "
                                                     "tp_comm_overlap), where it applies: tp > 1 with sequence "
                                                     "parallel; needs TE on CUDA and Megatron-LM")
    first_stage_layers: int | None = Field(None, ge=0, description="layers on the first pipeline stage; null = as "
                                                                   "the middle stages (megatron's uneven split)")
    last_stage_layers: int | None = Field(None, ge=0, description="layers on the last pipeline stage; null = as the "
                                                                  "middle stages")
    embedding_in_split: bool = Field(False, description="the embedding counts as one layer of the first stage "
                                                        "(megatron's account_for_embedding_in_pipeline_split)")
    loss_in_split: bool = Field(False, description="the output layer and loss count as one layer of the last stage "
                                                   "(megatron's account_for_loss_in_pipeline_split)")


class Zero(Section):
    stage: Literal[0, 1, 2, 3] = 1
    offload_optimizer: Offload = "none"
    offload_param: Offload = "none"
    nvme_path: str | None = None
    hpz_partition_size: int = Field(1, ge=1, description="ZeRO++ hierarchical partitioning, ZeRO-3 (DeepSpeed's "
                                    "zero_hpz_partition_size): after the forward's all-gather each GPU keeps "
                                    "1/N of the 16-bit parameters as a secondary partition over N neighbouring "
                                    "ranks (a node: gpus_per_node), and the backward gathers from those; 1 = off. "
                                    "toolkit plan --auto keeps 1")
    engine: Literal["deepspeed", "fsdp"] = Field(
        "deepspeed", description="who shards: deepspeed (what every target here runs: the generated DeepSpeed config, "
        "or Megatron-LM's distributed optimizer) or fsdp, PyTorch FSDP as a planning input for runs made with it "
        "(torchtitan, llm-foundry): stage 3 = FULL_SHARD, 2 = SHARD_GRAD_OP, 0 = NO_SHARD; one all-gather and one "
        "reduce-scatter per decoder layer (FSDP's unit), no per-module hooks; the rules refuse it for every target")


class FP8(Section):
    """TransformerEngine FP8 training (target megatron-lm): the linear layers of the transformer
    layers run their GEMMs in FP8 (megatron-core's fp8 fields: the embedding, the output layer and
    attention's own matmuls stay in ``precision``). A planning input: the estimates count it, the
    rules say where it cannot run (Hopper or newer, TransformerEngine, Megatron-LM)."""

    format: Literal["e4m3", "hybrid"] | None = Field(
        None, description="null = off; e4m3 everywhere, or hybrid: e4m3 forward, e5m2 for the gradients "
                          "(megatron's fp8, --fp8-format)")
    recipe: Literal["delayed", "tensorwise"] = Field(
        "delayed", description="delayed: scales from an amax history (megatron's default); tensorwise: current "
                               "per-tensor scaling, an amax pass before each cast (--fp8-recipe)")
    amax_history_len: int = Field(1, ge=1, description="delayed scaling's amax window (--fp8-amax-history-len; "
                                                       "Megatron-LM's default 1, TE's and NeMo's 1024)")
    param: bool = Field(False, description="keep the linear weights in FP8 and all-gather them in FP8, no 16-bit "
                                           "copy (megatron's fp8_param, --fp8-param-gather; needs zero.stage >= 1, "
                                           "its distributed optimizer)")
    bf16_layers: int = Field(0, ge=0, description="transformer layers kept out of FP8 at each end of the model "
                                                  "(megatron's first_last_layers_bf16 with num_layers_at_start/"
                                                  "end_in_bf16; NeMo's current-scaling recipe: 1)")

    @model_validator(mode="after")
    def _bf16_layers_need_current_scaling(self) -> FP8:
        if self.bf16_layers and self.recipe == "delayed":
            raise ValueError(f"bf16_layers={self.bf16_layers} with recipe delayed: megatron-core refuses it "
                             "('Delayed scaling does not support first / last layer in BF16'); use recipe tensorwise")
        return self

    @property
    def on(self) -> bool:
        return self.format is not None


class Batch(Section):
    micro: int = Field(1, ge=1)
    global_: int = Field(..., ge=1, alias="global")
    seq_len: int = Field(..., ge=1)


class Optimizer(Section):
    type: Literal["adamw"] = "adamw"
    impl: Literal["deepspeed", "torch"] = Field(
        "deepspeed", description="deepspeed: DeepSpeed builds the optimizer (required for offload); "
                                 "torch: a client torch.optim.AdamW")
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    grad_reduce_dtype: Literal["fp32", "bf16"] | None = Field(
        None, description="bf16 with target megatron-lm: the dtype of the gradient buffer and its reduction; "
                          "null = Megatron-LM's default, fp32 (4 bytes per parameter, not sharded); bf16 = "
                          "--grad-reduce-in-bf16 (NVIDIA's performance configs). DeepSpeed reduces in the "
                          "16-bit dtype into an fp32 partition (null only)")
    decay: Literal["cosine", "linear", "constant"] = "cosine"

    @model_validator(mode="after")
    def _min_lr_not_above_lr(self) -> Optimizer:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} is larger than lr={self.lr}")
        return self


class TensorBoardMonitor(Section):
    dir: str = Field("tensorboard", description="event files; a relative path is inside the run folder")


class WandbMonitor(Section):
    project: str
    name: str | None = Field(None, description="run name (default: the model's name)")
    group: str | None = None
    team: str | None = Field(None, description="W&B entity")
    offline: bool = Field(False, description="write to dir only (WANDB_MODE=offline); `wandb sync` uploads later")
    dir: str = Field("wandb", description="where wandb writes; a relative path is inside the run folder")


class CSVMonitor(Section):
    dir: str = Field("csv", description="one CSV file per metric; a relative path is inside the run folder")


class Monitor(Section):
    """Live metrics through DeepSpeed's monitors (null: off), besides metrics.jsonl."""

    tensorboard: TensorBoardMonitor | None = None
    wandb: WandbMonitor | None = None
    csv: CSVMonitor | None = None


class Train(Section):
    steps: int = Field(1000, ge=1)
    seed: int = 1234
    log_interval: int = Field(1, ge=1)
    save_interval: int = Field(1000, ge=1)
    data_path: str | None = Field(None, description="Megatron indexed dataset prefix (PREFIX.bin/.idx)")
    tokenizer: str | None = Field(None, description="HF tokenizer folder or name")
    save_dir: str = "checkpoints"
    keep_checkpoints: int | None = Field(None, ge=1, description="keep only the N newest complete checkpoints: "
                                                                 "older ones are removed once a newer one is "
                                                                 "complete; null = keep all")
    async_save: bool = Field(False, description="write checkpoints in the background while training goes on "
                                                "(megatron-core's asynchronous dist_checkpointing, as Megatron-LM's "
                                                "--async-save): a checkpoint becomes latest once every rank's files "
                                                "are complete, at the first step boundary after that")
    on_nan: Literal["stop", "skip"] = Field(
        "stop", description="a step whose loss or gradient norm is NaN or Inf (checked every step on every rank): "
                            "stop names the step and the rank and exits 5; skip drops the step's update (DeepSpeed's "
                            "own overflow skip) and counts it in metrics.jsonl (skipped_steps); under fp16 an overflowing gradient "
                            "norm alone is the loss scaler's own skip, not a bad step")
    monitor: Monitor = Monitor()
    eval_interval: int | None = Field(None, ge=1, description="validation loss every this many steps (and at the "
                                      "last step), Megatron-LM's --eval-interval; null = never")
    eval_iters: int = Field(100, ge=1, description="global batches per evaluation, each evaluation on the next "
                            "ones of the validation dataset (Megatron-LM's --eval-iters)")
    valid_data_path: str | None = Field(None, description="validation dataset prefix (`toolkit data prepare`; text "
                                        "or chat, as data_path), Megatron-LM's --valid-data-path")

    @model_validator(mode="after")
    def _eval_needs_data(self) -> Train:
        if self.eval_interval is not None and self.valid_data_path is None:
            raise ValueError("eval_interval needs valid_data_path (a dataset prefix from `toolkit data prepare`)")
        return self


class Data(Section):
    """How training data becomes sequences (chat data: `toolkit data prepare` of conversations)."""

    packing: bool = Field(False, description="chat data: several conversations per sequence, attention never "
                                             "crossing one and positions restarting in each (on CUDA: "
                                             "megatron's THD packed sequences, batch.micro 1)")
    fill: float | None = Field(None, gt=0, le=1, description="chat data: the share of a sequence's positions that "
                                                              "hold a conversation (the rest is padding), which the "
                                                              "plan's tokens/s counts as a run does; null = what "
                                                              "`toolkit data prepare --seq-len` recorded for "
                                                              "train.data_path, else 1")


class MoE(Section):
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    grouped_gemm: bool = False
    aux_loss_coeff: float | None = Field(None, ge=0, description="null = the model's router_aux_loss_coef")
    capacity_factor: float | None = Field(None, gt=0, description="null = no token dropping")
    pad_to_capacity: bool = Field(False, description="megatron's moe_pad_expert_input_to_capacity: every expert "
                                                     "computes exactly its capacity (capacity_factor x its "
                                                     "balanced share; tokens beyond it dropped, the rest "
                                                     "padded); needs capacity_factor")
    router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    bias_update_rate: float = Field(1e-3, gt=0, description="aux-loss-free routing (models with an expert "
                                                            "bias, DeepSeek-V3): the bias step per global batch")
    a2a_overlap: bool = Field(False, description="megatron's overlap_moe_expert_parallel_comm: one micro-batch's "
                                                 "expert-parallel all-to-alls run while another micro-batch "
                                                 "computes (merged forward/backward 1F1B), where it applies: "
                                                 "ep > 1, and vpp > 1 when pp > 1; needs Megatron-LM on CUDA")


class MTP(Section):
    """DeepSeek-V3's multi-token prediction modules (megatron-core's MTP block, on the last
    pipeline stage; their loss is added to the main loss in backward, as megatron does)."""

    layers: int | None = Field(None, ge=0, description="MTP modules after the decoder (megatron's mtp_num_layers); "
                                                        "null = the model's (a checkpoint's count, else 0)")
    loss_scale: float = Field(0.1, ge=0, description="the MTP loss's weight: megatron's mtp_loss_scaling_factor, "
                                                     "divided over the layers")


class Attention(Section):
    backend: Literal["auto", "flash", "unfused"] = Field(
        "auto", description="flash: no s^2 score matrix is stored (TransformerEngine's flash kernels, CUDA); "
                            "unfused: megatron's local attention stores it; auto: flash on a GPU, unfused on cpu")


class Estimate(Section):
    """Assumptions of the memory and time estimates, stated so they can be changed."""

    buffer_gib: float = Field(1.5, ge=0, description="CUDA context, NCCL and allocator fragmentation per GPU")
    headroom: float = Field(0.0, ge=0, lt=1, description="memory fraction kept free when judging fit")
    tokens: float | None = Field(None, gt=0, description="token budget for time-to-train (default: steps x global x seq)")
    pp_scatter_gather: bool = Field(False, description="without sequence parallelism each tp rank sends 1/tp of a "
                                    "pipeline activation and the receivers all-gather it (Megatron-LM Feb 2021 to "
                                    "Mar 2023); megatron-core sends it whole")
    pp_overlap: bool = Field(True, description="the interleaved schedule runs each pipeline send beside the next "
                             "chunk's compute (Megatron-LM's overlap_p2p_comm, added May 2023, its default with vpp "
                             "since Oct 2023); false: every send is waited for (Megatron-LM before May 2023: "
                             "batch_isend_irecv, then a device sync; this toolkit's runtime waits for each exchange "
                             "too)")
    grad_copy_freed: bool = Field(True, description="target megatron-lm with 16-bit gradients: the optimizer's fp32 "
                                  "copies of them exist only during its step (optimizer.zero_grad() frees them before "
                                  "the next forward, Megatron-LM since July 2021, commit 4fd6432); false: kept between "
                                  "steps, beside the activations (Megatron-LM of April 2021)")
    param_gather_at_start: bool = Field(
        False, description="target megatron-lm with the distributed optimizer: every pipeline stage dispatches its "
        "first parameter all-gather when the step starts, behind the pipeline fill (megatron-core 0.8 and earlier: "
        "in the optimizer's zero_grad, with or without interleaving); false: as Megatron-LM since megatron-core "
        "0.9, so with the interleaved schedule (align_param_gather) but without it each stage at its first "
        "forward, on demand: a later stage, one bucket (DistributedDataParallel), waits for its whole gather, "
        "and each wait delays the stages after it")
    hf_experts: Literal["fused", "modules"] = Field(
        "fused", description="target hf: how transformers holds a MoE layer's routed experts, which sets what "
        "DeepSpeed ZeRO-3 gathers at once and how many modules run its hooks: fused = one module per layer "
        "holding every expert's gate_up_proj and down_proj (transformers 5, which this toolkit runs); modules = "
        "a Linear module per expert weight (transformers 4.x: Mixtral's w1, w3, w2)")


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "in_proj", "out_proj")
HF_LORA_TARGETS = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj",
                   "gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2",
                   "in_proj_qkvz": "in_proj", "in_proj_ba": "in_proj"}  # peft's usual names (Qwen3-Next's delta net)


class LoRA(Section):
    """Low-rank adapters on megatron-core's tensor-parallel linear layers of every decoder
    layer (toolkit.runtime.lora): W x + (alpha / rank) B A dropout(x), B starting at zero."""

    rank: int = Field(8, ge=1, description="r: the inner size of each adapter")
    alpha: float = Field(16.0, gt=0, description="the adapter's output is scaled by alpha / rank (peft's lora_alpha)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (peft's lora_dropout)")
    targets: tuple[str, ...] = Field(LORA_TARGETS, min_length=1,
                                     description="megatron module names: linear_qkv, linear_proj (attention), "
                                                 "linear_fc1, linear_fc2 (MLP; not the experts of MoE layers), "
                                                 "in_proj, out_proj (a gated delta net's, Qwen3-Next)")

    @model_validator(mode="after")
    def _known_targets(self) -> LoRA:
        for name in self.targets:
            if name in HF_LORA_TARGETS:
                raise ValueError(f"unknown target '{name}': targets are megatron's module names, "
                                 f"Hugging Face's {name} is in '{HF_LORA_TARGETS[name]}'")
            if name not in LORA_TARGETS:
                raise ValueError(unknown_key_message(name, LORA_TARGETS).replace("unknown key", "unknown target", 1))
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets name a module twice: {list(self.targets)}")
        return self


class Finetune(Section):
    """What trains: every weight (full) or low-rank adapters on a frozen base (lora)."""

    method: Literal["full", "lora"] = "full"
    lora: LoRA = LoRA()


class Launch(Section):
    master_port: int = 29500
    script: str = Field("-m toolkit.cli.train", description="what the launchers start")
    script_args: list[str] = Field(default_factory=lambda: ["--spec", "spec.yaml"])
    hosts: list[str] = Field(default_factory=list, description="hostnames; default node-0 .. node-N-1")
    slurm_partition: str | None = None
    slurm_time: str = "48:00:00"
    slurm_notice_s: int = Field(600, ge=1, description="seconds before the time limit at which SLURM signals the "
                                "job (--signal=B:USR1@N): the run finishes its step, saves and the job requeues "
                                "itself; allow one step and one checkpoint save")


class TrainingSpec(Section):
    model: str  # registry name, or path to an HF config.json / model folder
    target: Literal["recipes", "megatron-lm", "hf"] = Field(
        "recipes", description="what trains the plan: recipes = this toolkit's runtime (DeepSpeed + megatron-core), "
                               "whose own limits are rules too; megatron-lm = Megatron-LM with the generated flags; "
                               "hf = the Hugging Face Trainer with the generated DeepSpeed config (toolkit.hf)")
    cluster: Cluster = Cluster()
    parallel: Parallel = Parallel()
    zero: Zero = Zero()
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    fp8: FP8 = FP8()
    batch: Batch
    recompute: Literal["none", "selective", "full", "op"] = Field(
        "selective", description="activation recompute: selective (megatron's: the attention core), full (whole "
                                 "layers) or none; left out with target hf: none (the HF Trainer checkpoints whole "
                                 "layers or nothing; selective is refused there); op = torchtitan's per-op "
                                 "checkpointing (selective_ac_option 'op': the outputs of every odd matmul and of "
                                 "attention kept, the rest recomputed), a planning input for dense layers at "
                                 "tp = cp = 1 that no target here runs (rule op_recompute)")
    compile: bool = Field(False, description="torch.compile of the model, a planning input: with target hf the "
                          "step time counts transformers' eager elementwise kernels unless true (fused, as "
                          "megatron-core's and Megatron-LM's kernels always are); no target's runtime here "
                          "compiles, so the rules refuse true")
    cross_entropy_fusion: Literal["none", "native", "te"] = Field(
        "none", description="megatron-core's loss over the logits: none = vocab_parallel_cross_entropy "
        "(megatron-core's and Megatron-LM's default: one kernel per step, 52 bytes per bf16 logit); native = its "
        "torch.compile'd fusion (cross_entropy_loss_fusion: NeMo's and Megatron-Bridge's default; bf16 only, as "
        "megatron casts its gradient to bf16); te = TransformerEngine's Triton kernel (cross_entropy_fusion_impl "
        "te; needs TransformerEngine's layers). Target hf runs transformers' own loss, so only none")
    optimizer: Optimizer = Optimizer()
    train: Train = Train()
    data: Data = Data()
    moe: MoE = MoE()
    mtp: MTP = MTP()
    attention: Attention = Attention()
    finetune: Finetune = Finetune()
    estimate: Estimate = Estimate()
    launch: Launch = Launch()
    deepspeed: dict[str, Any] = Field(
        default_factory=dict, description="extra DeepSpeed config keys merged over the generated JSON; the "
        "bucket sizes and reuse distance among them (zero_optimization) are the estimate's too")

    @model_validator(mode="after")
    def _hf_recompute_default(self) -> TrainingSpec:
        """Left out with target hf, recompute is none (the Trainer's default), not megatron's
        selective, which the HF Trainer does not have (rule hf_selective_recompute). It stays a
        default: not among given_keys, nor kept by with_overrides."""
        if self.target == "hf" and "recompute" not in self.model_fields_set:
            object.__setattr__(self, "recompute", "none")  # frozen section: the default, set once here
        return self

    # --- construction -------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingSpec:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(format_validation_error(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> TrainingSpec:
        p = Path(path)
        if not p.is_file():
            raise MissingInputError(f"spec file '{path}' does not exist")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise SpecError(f"{yaml_problem(e, str(path))}") from None
        if not isinstance(data, dict):
            raise SpecError(f"'{path}' must hold a mapping at the top level")
        return cls.from_dict(data)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self, assignments: dict[str, Any]) -> TrainingSpec:
        """New spec with dotted keys replaced: {"parallel.tp": 2, "batch.micro": 4}. Keys the
        spec left out stay left out (defaults, see ``given_keys``) unless assigned here."""
        data = self.model_dump(mode="json", by_alias=True, exclude_unset=True)
        for dotted, value in assignments.items():
            set_dotted(data, dotted, value)
        return TrainingSpec.from_dict(data)

    def given_keys(self) -> set[str]:
        """Dotted keys the spec's author wrote (or assigned with --set); the rest are defaults.
        ``toolkit plan --auto`` searches parallel, zero, recompute and batch.micro either way
        and shows the written layout, if any, beside its ranking."""
        return _given(self, "")


def _given(model: BaseModel, prefix: str) -> set[str]:
    keys = set()
    for name in model.model_fields_set:
        value, key = getattr(model, name), prefix + (type(model).model_fields[name].alias or name)
        keys |= _given(value, key + ".") if isinstance(value, BaseModel) else {key}
    return keys


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set a dotted key, creating sections on the way; validation names misspelled keys."""
    *parents, leaf = dotted.split(".")
    node = data
    for part in parents:
        if node.get(part) is None:
            node[part] = {}
        if not isinstance(node[part], dict):
            raise SpecError(f"cannot set '{dotted}': '{part}' is not a section")
        node = node[part]
    node[leaf] = value


def parse_assignment(text: str) -> tuple[str, Any]:
    """'parallel.tp=2' -> ("parallel.tp", 2); the value is parsed as YAML (numbers, bools, lists)."""
    if "=" not in text:
        raise SpecError(f"--set expects key=value, got '{text}'")
    key, raw = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise SpecError(f"--set {text}: the value {yaml_problem(e)}") from None


def yaml_problem(e: yaml.YAMLError, path: str | None = None) -> str:
    """One line: where (FILE:LINE:COLUMN, as compilers say it) and what PyYAML found, e.g.
    `spec.yaml:3:3: not valid YAML: expected ',' or '}', but got '<block mapping start>' (in the
    flow mapping that starts at 2:8)`."""
    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    note = ""
    if context and cmark is not None:
        note = f" ({context.replace('while parsing', 'in')} that starts at {cmark.line + 1}:{cmark.column + 1})"
    if path is None:
        return "is not valid YAML" + (f" at column {mark.column + 1}" if mark is not None else "") + f": {problem}"
    return f"{path}:{where}: not valid YAML: {problem}{note}" if where else f"{path}: not valid YAML: {problem}"


def format_validation_error(e: ValidationError) -> str:
    """One line per problem, each with its dotted location."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if p != "global_")
        msg = err["msg"].removeprefix("Value error, ")
        if msg.startswith("unknown key '") and loc:
            msg = msg.replace("unknown key '", f"unknown key '{loc}.", 1)
            parts.append(msg)
        else:
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "invalid spec: " + "; ".join(parts)
