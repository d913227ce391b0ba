"""Memory estimator: model states agree with DeepSpeed's own estimators and with the seeds'
16 bytes/parameter; activation terms follow Korthikanti et al."""
import pytest
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from toolkit.models import largest_module_params, load_model, total_params
from toolkit.plan import make_plan
from toolkit.kernels import kernels
from toolkit.estimate.memory import GiB, layer_activation_bytes
from toolkit.spec import TrainingSpec

from tests.conftest import spec_dict


def model_states(model, nodes, gpus, stage, opt="none", param="none"):
    spec = TrainingSpec.from_dict(spec_dict(**{
        "model": model, "cluster.nodes": nodes, "cluster.gpus_per_node": gpus, "parallel.tp": 1,
        "zero.stage": stage, "zero.offload_optimizer": opt, "zero.offload_param": param,
        "batch.global": nodes * gpus, "batch.seq_len": 2048}))
    return make_plan(spec).memory.worst.model_states


@pytest.mark.parametrize("model", ["llama3-8b", "qwen2-0.5b", "mixtral-8x7b"])
@pytest.mark.parametrize("nodes, gpus", [(1, 8), (8, 8), (64, 8)])
def test_zero2_matches_deepspeed(model, nodes, gpus):
    P = total_params(load_model(model))
    for offload in (False, True):
        _, ds = estimate_zero2_model_states_mem_needs(P, gpus, nodes, cpu_offload=offload)
        ours = model_states(model, nodes, gpus, 2, "cpu" if offload else "none")
        print(f"ZeRO-2 {model} {nodes}x{gpus} offload={offload}: ours {ours / GiB:.3f} GiB, "
              f"DeepSpeed {ds / GiB:.3f} GiB, relative difference {abs(ours - ds) / ds:.1e}")
        assert abs(ours - ds) / ds < 0.01, (offload, ours / GiB, ds / GiB)


@pytest.mark.parametrize("model", ["llama3-8b", "qwen2-0.5b", "mixtral-8x7b"])
@pytest.mark.parametrize("nodes, gpus", [(1, 8), (8, 8), (64, 8)])
def test_zero3_matches_deepspeed(model, nodes, gpus):
    shape = load_model(model)
    P, L = total_params(shape), largest_module_params(shape)
    for opt, param in ((False, False), (True, False), (True, True)):
        _, ds, _ = estimate_zero3_model_states_mem_needs(P, L, gpus, nodes, cpu_offload=opt, cpu_offload_params=param)
        ours = model_states(model, nodes, gpus, 3, "cpu" if opt else "none", "cpu" if param else "none")
        print(f"ZeRO-3 {model} {nodes}x{gpus} offload optimizer={opt} params={param}: ours {ours / GiB:.3f} GiB, "
              f"DeepSpeed {ds / GiB:.3f} GiB, relative difference {abs(ours - ds) / ds:.1e}")
        assert abs(ours - ds) / ds < 0.01, (opt, param, ours / GiB, ds / GiB)


def test_seed_16_bytes_per_parameter():
    """Seeds: mixed-precision Adam is 16 B/param; LLaMA-70B about 1120 GB unsharded."""
    spec = TrainingSpec.from_yaml(__import__("tests.conftest").conftest.ROOT / "examples/llama70b_1024gpu.yaml")
    plan = make_plan(spec)
    assert plan.memory.classic_model_states == 16 * total_params(plan.shape)
    assert abs(plan.memory.classic_model_states / 1e9 - 1120) / 1120 < 0.01
    # with no sharding at all the classic terms are params 2 + grads 2 + optimizer 12
    one = make_plan(TrainingSpec.from_dict(spec_dict(**{"model": "llama3-8b", "cluster.gpus_per_node": 1,
                                                        "parallel.tp": 1, "zero.stage": 1, "batch.global": 1})))
    w = one.memory.worst
    P = total_params(one.shape)
    assert (w.params, w.optimizer) == (2 * P, 12 * P)
    assert w.grads == (2 + 4) * P  # 16-bit gradients + DeepSpeed's fp32 copy for the optimizer step


def _layout(tp=1, sp=False, cp=1, etp=1):
    from toolkit.parallel.layout import Layout
    return Layout(world=8, tp=tp, pp=1, vpp=1, ep=1, etp=etp, cp=cp, sequence_parallel=sp,
                  gpus_per_node=8)


GPU_FLASH, GPU_UNFUSED = kernels("h100-80gb", "flash"), kernels("h100-80gb", "unfused")


def test_activations_llama70b_close_to_korthikanti_34sbh():
    """Flash attention and fused kernels on a GPU: 33.5 h bytes per token and layer."""
    s = load_model("llama3-70b")
    kw = dict(tokens=4096, seq=4096, recompute="none", kernels=GPU_FLASH, act_bytes=2)
    per_layer = layer_activation_bytes(s, 0, layout=_layout(), **kw)
    assert per_layer == pytest.approx(33.5 * 4096 * s.hidden_size, rel=1e-3)  # paper: 34 sbh with dropout masks
    # tensor + sequence parallel divide everything by t; without SP the 8h of norm/linear inputs stays
    assert layer_activation_bytes(s, 0, layout=_layout(8, True), **kw) == pytest.approx(per_layer / 8, rel=1e-3)
    no_sp = layer_activation_bytes(s, 0, layout=_layout(8, False), **kw)
    assert no_sp == pytest.approx(4096 * s.hidden_size * (8 + 25.5 / 8), rel=1e-3)


def test_activations_unfused_attention_and_recompute():
    """megatron's local attention keeps the fp32 softmax (4 a s) and its 16-bit copy (2 a s),
    plus q, k, v expanded to 32 heads and the output (4 a d), where flash keeps q, k, v
    unexpanded and the output (2 a d + 2 g d) and a log-sum-exp (4 a); measured on CPU in
    tests/toolkit/estimate/test_activations.py."""
    s = load_model("llama3-8b")
    a, g, d, seq = 32, 8, 128, 4096
    kw = dict(tokens=4096, seq=seq, act_bytes=2, layout=_layout())
    unfused = layer_activation_bytes(s, 0, recompute="none", kernels=GPU_UNFUSED, **kw)
    flash = layer_activation_bytes(s, 0, recompute="none", kernels=GPU_FLASH, **kw)
    per_token = (2 * 4 * a * d + 6 * a * seq) - (2 * (2 * a * d + 2 * g * d) + 4 * a)
    assert unfused - flash == pytest.approx(4096 * per_token, rel=1e-9)
    selective = layer_activation_bytes(s, 0, recompute="selective", kernels=GPU_UNFUSED, **kw)
    assert unfused - selective == pytest.approx(4096 * (6 * a * seq + 2 * (4 * a * d - (3 * a * d + 3 * g * d))))
    assert layer_activation_bytes(s, 0, recompute="full", kernels=GPU_FLASH, **kw) == 2 * 4096 * s.hidden_size


def _megatron_warmup(pp: int, vpp: int, stage: int, microbatches: int, a2a: bool = False) -> tuple[int, int]:
    """(total chunk forwards, warm-up forwards) of megatron-core's schedule for one stage
    (``a2a``: with its EP all-to-all overlap)."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    group = SimpleNamespace(size=lambda: pp, rank=lambda: stage)
    comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    total, _, warmup, _ = get_pp_rank_microbatches(microbatches, vpp, pp, p2p_communicator=comm,
                                                   overlap_moe_expert_parallel_comm=a2a)
    return total, warmup


@pytest.mark.parametrize("pp, vpp", [(2, 2), (4, 3), (8, 4), (16, 2)])
def test_a2a_overlap_warmup_is_megatrons(pp, vpp):
    """With megatron's EP all-to-all overlap: one warm-up forward more held in memory, and the
    share of chunks whose all-to-alls the step-time model hides is megatron's steady state."""
    from toolkit.estimate.time import a2a_overlap_shares
    from toolkit.parallel.layout import Layout
    from toolkit.estimate.memory import in_flight

    lay = Layout(world=2 * pp, tp=1, pp=pp, vpp=vpp, ep=2, etp=1, cp=1, sequence_parallel=False,
                 gpus_per_node=8, ep_a2a_overlap=True)
    for m in (pp, 2 * pp, 8 * pp):
        shares = a2a_overlap_shares(lay, m)
        for k in range(pp):
            total, warmup = _megatron_warmup(pp, vpp, k, m, a2a=True)
            chunks = total if warmup >= total else warmup + 1
            assert in_flight(lay, k, m) == pytest.approx(chunks / vpp), (m, k)
            assert shares[k] == pytest.approx((total - warmup) / total), (m, k)


@pytest.mark.parametrize("pp, vpp", [(2, 1), (4, 1), (8, 1), (2, 2), (4, 3), (8, 5), (16, 2)])
def test_in_flight_is_megatrons_warmup_plus_one(pp, vpp):
    """The micro-batches a stage holds at its peak: megatron's warm-up forwards plus the first
    steady-state forward (all of them when every forward is warm-up), in whole stages."""
    from toolkit.parallel.layout import Layout
    from toolkit.estimate.memory import in_flight

    lay = Layout(world=pp, tp=1, pp=pp, vpp=vpp, ep=1, etp=1, cp=1, sequence_parallel=False,
                 gpus_per_node=8)
    for m in (pp, 2 * pp, 8 * pp):
        for k in range(pp):
            total, warmup = _megatron_warmup(pp, vpp, k, m)
            chunks = total if warmup >= total else warmup + 1
            assert in_flight(lay, k, m) == pytest.approx(chunks / vpp), (m, k)
    if (pp, vpp) == (8, 5):  # issue 18 item 6: the last stage holds 6.6 micro-batches, not 2.4
        assert in_flight(lay, 7, 64) == pytest.approx(6.6)


@pytest.mark.parametrize("layers, pp, vpp", [(126, 16, 8), (126, 16, 4), (4, 2, 3), (14, 4, 2), (22, 8, 3)])
def test_in_flight_follows_megatrons_order_where_chunks_differ(layers, pp, vpp):
    """Embedding and loss accounted as layers: the first chunk of the first stage and the last
    chunk of the last stage hold a layer fewer. The layers held at the peak are those of
    megatron-core's own order: its get_schedule_table, its warm-up count, forward k + warmup
    then backward k of chunk vpp - 1 - c, replayed here layer by layer."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from toolkit.parallel.layout import Layout
    from toolkit.estimate.memory import in_flight
    from toolkit.parallel.pipeline import PipelineSplit

    split = PipelineSplit(layers, pp, vpp, embedding=True, loss=True)
    assert not split.problems()
    lay = Layout(world=pp, tp=1, pp=pp, vpp=vpp, ep=1, etp=1, cp=1, sequence_parallel=False,
                 gpus_per_node=8, embedding_in_split=True, loss_in_split=True, num_layers=layers)
    for m in (pp, 2 * pp, 4 * pp):
        table = [c for _, c in get_schedule_table(m, vpp, pp)]
        for k in range(pp):
            size = [split.layers(k, c) for c in range(vpp)]
            total, warmup = _megatron_warmup(pp, vpp, k, m)
            held = peak = sum(size[c] for c in table[:warmup])
            for i in range(total - warmup):
                held += size[table[i + warmup]]
                peak = max(peak, held)
                held -= size[vpp - 1 - table[i]]
            assert in_flight(lay, k, m) * split.stage_count(k) == pytest.approx(peak), (m, k)
    if (layers, pp, vpp) == (126, 16, 8):  # Llama 3 405B: 112 and 113 layers, not the mean's 125 and 99
        assert in_flight(lay, 0, 32) * 7 == pytest.approx(112) and in_flight(lay, 15, 32) * 7 == pytest.approx(113)


def test_pipeline_in_flight_microbatches():
    base = {"model": "llama3-70b", "cluster.nodes": 8, "parallel.tp": 8, "parallel.pp": 8, "batch.global": 64,
            "recompute": "selective"}
    one = make_plan(TrainingSpec.from_dict(spec_dict(**base)))
    st = one.memory.stages
    # 1F1B: stage k holds p - k micro-batches of its layers; the last stage also holds logits
    assert st[0].activations / st[1].activations == pytest.approx(8 / 7, rel=1e-6)
    inter = make_plan(TrainingSpec.from_dict(spec_dict(**base, **{"parallel.vpp": 5})))
    ratio = inter.memory.stages[0].activations / st[0].activations
    assert ratio == pytest.approx(1 + 7 / (8 * 5), rel=1e-6)  # Korthikanti: 1 + (p-1)/(p v)


def test_megatron_lm_gradients_in_an_fp32_buffer():
    """Megatron-LM with bf16 accumulates and reduces gradients in an fp32 buffer of every
    parameter (its arguments.py sets accumulate_allreduce_grads_in_fp32 unless
    --grad-reduce-in-bf16) that the distributed optimizer reads in place; with
    --grad-reduce-in-bf16 the buffer is bf16 and the shard is copied to fp32 for the step only
    (megatron-core's DistributedOptimizer._copy_model_grads_to_main_grads: ``.float()``; Megatron-LM's
    train_step frees it with optimizer.zero_grad() before the next forward). DeepSpeed's bf16
    ZeRO-1 (its BF16_Optimizer, memory.bf16_states) keeps an unsharded fp32 buffer beside the
    bf16 gradients, and its fp16 ZeRO-1 the 4/N fp32 partition (DeepSpeed's own count). The
    optimizer state is the same in all of them."""
    from toolkit.emit.megatron import megatron_lm_args

    over = {"zero.stage": 1}
    fp32 = make_plan(TrainingSpec.from_dict(spec_dict(target="megatron-lm", **over)))
    bf16 = make_plan(TrainingSpec.from_dict(spec_dict(target="megatron-lm", **over,
                                                      **{"optimizer.grad_reduce_dtype": "bf16"})))
    ds = make_plan(TrainingSpec.from_dict(spec_dict(target="recipes", **over)))
    n_shard = fp32.layout.dp * fp32.layout.cp
    a, b, c = (p.memory.stages[0] for p in (fp32, bf16, ds))
    assert a.grads == pytest.approx(2 * a.params)  # 4 bytes per bf16 (2-byte) parameter, not sharded
    assert b.grads == pytest.approx(a.params) and b.step_only == pytest.approx(a.params * 4 / n_shard / 2)
    assert b.total == pytest.approx(b.model_states + b.activations + b.buffers)  # the step's copy < activations
    assert c.grads == pytest.approx(a.params * (2 + 4) / 2) and c.step_only == pytest.approx(a.params)
    fp16 = make_plan(TrainingSpec.from_dict(spec_dict(target="recipes", precision="fp16", **over))).memory.stages[0]
    assert fp16.grads == pytest.approx(a.params * (2 + 4 / n_shard) / 2) and fp16.step_only == 0
    assert c.buffers < fp16.buffers  # BF16_Optimizer all-reduces its buffer: no stage_1_and_2 reduce buckets
    assert a.optimizer == b.optimizer == c.optimizer == fp16.optimizer and a.step_only == 0
    # Megatron-LM before July 2021 (commit 4fd6432) kept the fp32 copies between steps
    kept = make_plan(TrainingSpec.from_dict(spec_dict(target="megatron-lm", **over, **{
        "optimizer.grad_reduce_dtype": "bf16", "estimate.grad_copy_freed": False}))).memory.stages[0]
    assert kept.grads == pytest.approx(a.params * (2 + 4 / n_shard) / 2) and kept.step_only == 0
    assert "--grad-reduce-in-bf16" in megatron_lm_args(bf16) and "--grad-reduce-in-bf16" not in megatron_lm_args(fp32)
    assert fp32.time.seconds["dp"] >= bf16.time.seconds["dp"]  # twice the bytes reduce-scattered


def _selects_the_optimizer(cfg: dict) -> dict:
    """The config keys DeepSpeed's engine picks its optimizer wrapper by (_do_optimizer_sanity_check)."""
    z = cfg["zero_optimization"]
    return {"bf16": cfg["bf16"], "data_types": cfg.get("data_types"), "stage": z["stage"],
            "offload_optimizer": z.get("offload_optimizer")}


def test_hf_trainer_gives_deepspeed_the_same_bf16_zero1_choice(ds_dist, tmp_path):
    """Target hf: the config the HF Trainer hands DeepSpeed (transformers' HfTrainerDeepSpeedConfig
    after TrainingArguments fills its "auto" values) selects BF16_Optimizer by the same keys as
    the recipes runtime's config, which the test below builds DeepSpeed's engine from."""
    from toolkit.estimate.memory import grad_copy
    from toolkit.hf import training_arguments
    from toolkit.runtime.engine import runtime_config

    over = {"model": "qwen2-0.5b", "cluster.gpus_per_node": 1, "parallel.tp": 1, "batch.global": 1,
            "recompute": "none"}  # the HF Trainer has no selective recompute (rule hf_selective_recompute)
    hf_spec, recipes_spec = (TrainingSpec.from_dict(spec_dict(target=t, **over)) for t in ("hf", "recipes"))
    hf = training_arguments(hf_spec, tmp_path, use_cpu=True)
    recipes = runtime_config(make_plan(recipes_spec), cuda=False)
    assert grad_copy(hf_spec) == grad_copy(recipes_spec) == "full"  # the estimate counts them alike
    assert _selects_the_optimizer(hf.hf_deepspeed_config.config) == _selects_the_optimizer(recipes) == {
        "bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}, "stage": 1, "offload_optimizer": None}


def test_bf16_zero1_counts_what_deepspeeds_bf16_optimizer_holds(ds_dist, monkeypatch):
    """bf16 ZeRO-1 without offload: DeepSpeed's engine, given the config the toolkit generates,
    builds its BF16_Optimizer, whose tensors are measured against memory.bf16_states for the same
    parameter count. One rank (N = 1); in bf16_optimizer.py the fp32 master partition and Adam's
    moments are ``partition_size = flat.numel() // dp`` elements (4/N, 8/N), while the fp32
    gradient buffer is ``zeros_like`` the whole flat bf16 group (4, not sharded), as are the bf16
    weights and their ``.grad`` (2 + 2) and the boundary all-reduce's bf16 copy (2)."""
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from toolkit.estimate.memory import grad_copy, model_state_bytes
    from toolkit.runtime.engine import runtime_config

    plan = make_plan(TrainingSpec.from_dict(spec_dict(target="recipes", **{
        "model": "qwen2-0.5b", "cluster.gpus_per_node": 1, "parallel.tp": 1, "batch.global": 1})))
    assert plan.layout.dp == 1 and plan.batch.grad_accum == 1
    cfg = runtime_config(plan, cuda=False)
    assert cfg["data_types"] == {"grad_accum_dtype": "fp32"} and "immediate_grad_update" not in cfg["bf16"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 32))
    n = sum(p.numel() for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    opt = engine.optimizer
    assert isinstance(opt, BF16_Optimizer) and not opt.immediate_grad_update

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors)

    reduced = []  # (elements, bytes) of what the engine all-reduces

    def all_reduce(tensor, *args, real=dist.all_reduce, **kw):
        reduced.append((tensor.numel(), tensor.numel() * tensor.element_size()))
        return real(tensor, *args, **kw)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    engine.backward(engine(x).float().square().mean())
    lp_grads = nbytes(p.grad for p in engine.module.parameters())
    engine.step()
    adam = nbytes(t for s in opt.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1)
    measured = dict(params=nbytes(opt.bf16_groups_flat), grad_buffer=nbytes(opt.fp32_groups_gradients_flat),
                    lp_grads=lp_grads, master=nbytes(opt.fp32_groups_flat_partition), adam=adam,
                    reduce_copy=sum(b for e, b in reduced if e == n))
    params, grads, optimizer, offloaded, step_only = model_state_bytes(
        n, 1, stage=1, precision="bf16", offload_optimizer=False, offload_param=False, copy=grad_copy(plan.spec))
    print(f"recipes: n = {n} parameters, measured {measured}; estimated params {params}, grads {grads}, "
          f"optimizer {optimizer}, step_only {step_only}")
    assert measured["params"] == params == 2 * n
    assert measured["grad_buffer"] + measured["lp_grads"] == grads == 6 * n
    assert measured["master"] + measured["adam"] == optimizer == 12 * n
    assert measured["reduce_copy"] == step_only == 2 * n and offloaded == 0
    engine.destroy()
