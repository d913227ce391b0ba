"""Resume at another layout (issue 16): for each pair A -> B, run A for 2N steps (saving at N),
then resume A's step-N checkpoint at layout B for N steps. B's losses must be A's steps
N+1..2N within the round-off bound (test_recipes.same_curve, measured by ROUND_OFF's
twins), and the optimizer state right after B loaded must equal the state A saved, bit for
bit, per parameter: both sides gathered with DeepSpeed's own ``safe_get_full_fp32_param`` /
``safe_get_full_optimizer_state`` and placed in global tensors by megatron-core's own sharding
metadata (tests/support/optimizer_dump.py).

Conversions (`toolkit convert run-state`), in the same 2-rank launch, each checked against the
other tool's own code:
- DeepSpeed: A's checkpoint -> DeepSpeed's own ZeRO files (`--to deepspeed`), which DeepSpeed's
  zero_to_fp32.py and ds_to_universal read into A's masters and moments;
  A's checkpoint -> universal -> a plain DeepSpeed engine (`load_universal`, at tp 1
  and, with an mpu, tp 2) holds A's optimizer state bit for bit and continues A's loss curve
  (tp 2 with DeepSpeed's own scheduler from the generated ds_config.json: it continues the
  learning rate of an uninterrupted run with that scheduler); a
  plain DeepSpeed run's own checkpoint -> DeepSpeed's `ds_to_universal` -> runtime -> resumed
  at tp 2 holds that run's state and continues its curve;
- Megatron-LM: A's checkpoint -> megatron-lm: the optimizer keys and shapes are exactly those
  megatron-core's DistributedOptimizer.sharded_state_dict asks for (tp 1), it loads A's state
  bit for bit; what megatron then saves itself -> runtime -> resumed at tp 2 continues A's curve.
- what cannot carry over (another data order or sample length, another model, another
  learning-rate schedule without a flag saying which) stops setup with one line;
- a run planned for 6 steps stopped after 3 by --exit-interval and resumed into the same folder
  continues the uninterrupted run exactly (losses and learning rates), and says what it resumed;
- another global batch (8 -> 16 after step 2) reads on from the samples consumed: which dataset
  samples each step handed to the model, on each rank, recorded in the run.

The 2-rank pairs and conversions run in ONE torchrun launch (tests/support/runtime_worker.py; tiny
flavours, fp32 on CPU); the 4-rank pairs (the issue's tp2 pp2 -> dp4, and interleaved pp2 vpp2
-> tp2 cp2) in tests/toolkit/runtime/test_layouts.py's 4-rank launch, with FOUR_PAIRS and check_pair
from here. Largest differences print with `pytest -s`.
"""
import json

import pytest
import torch

from tests.conftest import SUPPORT
from tests.support.optimizer_dump import STATES, assemble
from tests.recipes.test_recipes import launch, metrics, same_curve, tail

N = 3
LLAMA, MIXTRAL = "llama8b", "mixtral8x7b"
SOURCES = {  # name -> (recipe, spec overrides): the uninterrupted runs A
    "dp2 ZeRO-1": (LLAMA, {"zero.stage": 1}),
    "tp2 ZeRO-2": (LLAMA, {"parallel.tp": 2, "zero.stage": 2}),
    "pp2 ZeRO-1": (LLAMA, {"parallel.pp": 2, "zero.stage": 1}),
    "dp2 ZeRO-2": (LLAMA, {"zero.stage": 2}),
    "mixtral ep2 ZeRO-1": (MIXTRAL, {"parallel.ep": 2, "zero.stage": 1}),
}
PAIRS = {  # (source A, resumed layout B) -> B's spec overrides
    ("dp2 ZeRO-1", "tp2 ZeRO-1"): {"parallel.tp": 2, "zero.stage": 1},
    ("tp2 ZeRO-2", "pp2 ZeRO-1"): {"parallel.pp": 2, "zero.stage": 1},
    ("pp2 ZeRO-1", "dp2 ZeRO-2"): {"zero.stage": 2},
    ("dp2 ZeRO-2", "dp2 ZeRO-3"): {"zero.stage": 3},
    ("dp2 ZeRO-1", "dp2 ZeRO-1 + CPU optimizer offload"): {"zero.stage": 1, "zero.offload_optimizer": "cpu"},
    ("mixtral ep2 ZeRO-1", "mixtral dp2 ZeRO-1"): {"zero.stage": 1},
}
FOUR = {"tp2 pp2 ZeRO-1": {"parallel.tp": 2, "parallel.pp": 2, "zero.stage": 1},
        "pp2 vpp2 ZeRO-1": {"parallel.pp": 2, "parallel.vpp": 2, "zero.stage": 1}}
FOUR_PAIRS = {("tp2 pp2 ZeRO-1", "dp4 ZeRO-1"): {"zero.stage": 1},  # the 4-rank pair
              ("pp2 vpp2 ZeRO-1", "tp2 cp2 ZeRO-1"): {"parallel.tp": 2, "parallel.cp": 2, "zero.stage": 1}}


def slug(name: str) -> str:
    return name.replace(" ", "_").replace("+", "plus")


def pair_slug(a: str, b: str) -> str:
    return f"{slug(a)}__to__{slug(b)}"


def _runs(tmp, sources: dict, pairs: dict) -> list[dict]:
    base = {"recompute": "none", "train.save_interval": N}
    items = [{"name": n, "recipe": r, "sets": {**base, **over}, "steps": 2 * N, "out": str(tmp / slug(n)),
              "dump_optimizer": True} for n, (r, over) in sources.items()]
    items += [{"name": f"{a} -> {b}", "recipe": sources[a][0], "sets": {**base, **over}, "steps": 2 * N,
               "out": str(tmp / pair_slug(a, b)), "load": str(tmp / slug(a) / "checkpoints" / f"global_step{N}"),
               "dump_optimizer": True} for (a, b), over in pairs.items()]
    return items


def _convert(src, out, to: str, *extra: str) -> dict:
    return {"command": ["{python}", "-m", "toolkit", "convert", "run-state", str(src), str(out), "--to", to, *extra],
            "out": str(out) + ".cmd"}


def _conversions(tmp) -> list[dict]:
    """Items after the pairs: universal out and in, Megatron-LM out and in, refusals."""
    from toolkit.models import named_models

    (tmp / "llama-tiny").mkdir()
    (tmp / "llama-tiny" / "config.json").write_text(json.dumps(named_models()["llama-tiny"]["config"]))
    a = tmp / slug("dp2 ZeRO-1") / "checkpoints" / f"global_step{N}"
    z1, tp2 = {"zero.stage": 1, "recompute": "none"}, {"parallel.tp": 2, "zero.stage": 1, "recompute": "none"}
    run = lambda name, sets, **kw: {"name": name, "recipe": LLAMA, "sets": sets, "steps": 2 * N,  # noqa: E731
                                    "out": str(tmp / name), **kw}
    return [
        _convert(a, tmp / "uc", "universal"),
        _convert(a, tmp / "ds_zero", "deepspeed"),
        {"command": ["{python}", str(tmp / "ds_zero" / "zero_to_fp32.py"), str(tmp / "ds_zero"),
                     str(tmp / "ds_zero_fp32")], "out": str(tmp / "ds_zero_fp32.cmd")},
        {"command": ["{python}", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                     str(tmp / "ds_zero" / f"global_step{N}"), "--output_folder",
                     str(tmp / "ds_zero_uc" / f"global_step{N}"), "--num_extract_workers", "1",
                     "--num_merge_workers", "1", "--inject_missing_state"], "out": str(tmp / "ds_zero_uc.cmd")},
        run("uc_plain_tp1", z1, plain={"load_universal": str(tmp / "uc")}),
        run("uc_plain_tp2", tp2, plain={"load_universal": str(tmp / "uc"), "scheduler": "deepspeed"}),
        run("plain_deepspeed_scheduler", z1, plain={"scheduler": "deepspeed"}),
        run("plain", {**z1, "train.save_interval": N}, plain={"save_at": N}),
        {"command": ["{python}", "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                     str(tmp / "plain" / "ds" / f"global_step{N}"), "--output_folder",
                     str(tmp / "plain_uc" / f"global_step{N}"), "--num_extract_workers", "1",
                     "--num_merge_workers", "1", "--inject_missing_state"], "out": str(tmp / "plain_uc.cmd")},
        _convert(tmp / "plain_uc", tmp / "plain_rt", "runtime", "--hf-config", str(tmp / "llama-tiny")),
        run("plain_resumed_tp2", tp2, load=str(tmp / "plain_rt"), dump_optimizer=True),
        _convert(a, tmp / "mlm", "megatron-lm"),
        run("megatron", z1, megatron_optimizer={"load": str(tmp / "mlm" / f"iter_{N:07d}"),
                                                "save": str(tmp / "mlm_saved")}),
        _convert(tmp / "mlm_saved", tmp / "mlm_rt", "runtime"),
        run("megatron_resumed_tp2", tp2, load=str(tmp / "mlm_rt"), dump_optimizer=True),
        run("refuse_seed", {**z1, "train.seed": 7}, load=str(a), expect_error=True),
        {**run("refuse_model", z1, load=str(a), expect_error=True), "recipe": MIXTRAL},
        run("refuse_seq_len", {**z1, "batch.seq_len": 32}, load=str(a), expect_error=True),
        run("refuse_schedule", z1, load=str(a), steps=2 * N + 2, expect_error=True),
    ]


def _resume_rules(tmp) -> list[dict]:
    """Items after the conversions: --exit-interval then --load into the same folder (the
    README's way to train longer); another global batch on resume."""
    z1 = {"zero.stage": 1, "recompute": "none", "train.save_interval": N}
    b8 = {"zero.stage": 1, "recompute": "none", "train.save_interval": 2}
    run = lambda name, sets, **kw: {"name": name, "recipe": LLAMA, "sets": sets, "steps": 2 * N,  # noqa: E731
                                    "out": str(tmp / name.split(" ")[0]), **kw}
    return [
        run("exit", z1, exit_interval=N),
        run("exit resumed", z1, load=str(tmp / "exit")),
        run("batch8", b8, steps=4, record_samples=True),
        run("batch16", {**b8, "batch.global": 16}, steps=4, load=str(tmp / "batch8" / "checkpoints" / "global_step2"),
            scheduler="override", record_samples=True),
    ]


ROUND_OFF = {LLAMA: "dp2 ZeRO-1", MIXTRAL: "mixtral ep2 ZeRO-1"}  # each recipe's round-off reference (2 ranks)


def twins(tmp, references: dict[str, tuple[str, dict]]) -> list[dict]:
    """The references nudged by one ulp: `same_curve`'s twins."""
    return [{"name": f"{n} twin", "recipe": r, "sets": {"recompute": "none", **over}, "steps": 2 * N, "nudge": True,
             "out": str(tmp / slug(f"{n} twin"))} for n, (r, over) in references.items()]


def twin_of(tmp, reference: str) -> list[dict]:
    return metrics(tmp / slug(f"{reference} twin"))


def _launch(tmp, items: list[dict], nproc: int) -> None:
    (tmp / "runs.json").write_text(json.dumps(items))
    r = launch(str(SUPPORT / "runtime_worker.py"), str(tmp / "runs.json"), launcher="torchrun", nproc=nproc,
               timeout=1800)
    assert r.returncode == 0, tail(r)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("resume2")
    refs = {n: SOURCES[n] for n in ROUND_OFF.values()}
    _launch(tmp, _runs(tmp, SOURCES, PAIRS) + twins(tmp, refs) + _conversions(tmp) + _resume_rules(tmp), 2)
    return tmp


def four_rank_runs(tmp) -> list[dict]:
    """The 4-rank pairs' runs, items of tests/toolkit/runtime/test_layouts.py's launch."""
    return _runs(tmp, {n: (LLAMA, o) for n, o in FOUR.items()}, FOUR_PAIRS)


def same_state(saved_dir, loaded_dir) -> str:
    """Both dumps hold the same step and, bit for bit, the same masters and moments."""
    saved_steps, saved = assemble(saved_dir)
    loaded_steps, loaded = assemble(loaded_dir)
    assert saved_steps == loaded_steps == {N}, (saved_steps, loaded_steps)
    assert saved.keys() == loaded.keys() and saved, (sorted(saved), sorted(loaded))
    differ = [f"{k} {s}" for k in saved for s in STATES if not torch.equal(saved[k][s], loaded[k][s])]
    assert not differ, differ[:5]
    numel = sum(t["param"].numel() for t in saved.values())
    return f"{len(saved)} tensors x {len(STATES)} states ({numel} elements each) bit-identical"


def continues(whole: list[dict], resumed: list[dict], twin: list[dict]) -> str:
    """Resumed steps N+1..2N stay on the uninterrupted run's curve (within the round-off that
    `twin`, a run of the same model nudged by one ulp, shows by each step)."""
    assert [m["step"] for m in resumed] == list(range(N + 1, 2 * N + 1))
    loss = max(abs(x["loss"] - y["loss"]) for x, y in zip(resumed, whole[N:2 * N]))
    off = same_curve(resumed, whole, twin)
    assert off < 1, (loss, off)
    return f"{loss:.1e} ({off:.2f} of the round-off bound)"


def check_pair(tmp, a: str, b: str, twin: list[dict]) -> None:
    state = same_state(tmp / slug(a) / "optim" / f"save_step{N}", tmp / pair_slug(a, b) / "optim" / f"load_step{N}")
    loss = continues(metrics(tmp / slug(a)), metrics(tmp / pair_slug(a, b)), twin)
    print(f"{a} -> {b}: steps {N + 1}..{2 * N} max |loss diff| {loss}; optimizer state after loading: {state}")


@pytest.mark.multirank
@pytest.mark.parametrize("a,b", list(PAIRS), ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_at_another_layout(two, a, b):
    check_pair(two, a, b, twin_of(two, ROUND_OFF[SOURCES[a][0]]))


SAVED_A = (slug("dp2 ZeRO-1"), "optim", f"save_step{N}")


@pytest.mark.multirank
def test_universal_checkpoint_into_a_plain_deepspeed_engine(two):
    """runtime -> universal -> DeepSpeed's own load_universal, at tp 1 and (with an mpu) tp 2."""
    a = two.joinpath(*SAVED_A)
    tp1 = same_state(a, two / "uc_plain_tp1" / "optim" / f"load_step{N}")
    tp2 = same_state(a, two / "uc_plain_tp2" / "optim" / f"load_step{N}")
    loss = continues(metrics(two / slug("dp2 ZeRO-1")), metrics(two / "uc_plain_tp1"), twin_of(two, ROUND_OFF[LLAMA]))
    print(f"runtime -> universal -> plain DeepSpeed engine: tp1 {tp1}, tp2 {tp2}; steps {N + 1}..{2 * N} "
          f"max |loss diff| vs the uninterrupted run {loss}")


@pytest.mark.multirank
def test_deepspeed_zero_files_are_what_deepspeeds_own_tools_read(two):
    """runtime -> `--to deepspeed` (DeepSpeed's engine writes its own ZeRO files): DeepSpeed's
    zero_to_fp32.py gives the fp32 masters, and its ds_to_universal the masters and both Adam
    moments, of the universal checkpoint above (which DeepSpeed loads as A's state, bit for
    bit), every tensor equal, the vocabulary padding aside."""
    from safetensors.torch import load_file

    uc = two / "uc" / f"global_step{N}" / "zero"
    names = sorted(d.name for d in uc.iterdir() if d.is_dir())
    fp32 = {}
    for f in sorted((two / "ds_zero_fp32").glob("*")):
        fp32.update(load_file(f) if f.suffix == ".safetensors" else torch.load(f, weights_only=True))
    ds_uc = two / "ds_zero_uc" / f"global_step{N}" / "zero"
    assert set(fp32) == set(names) and sorted(d.name for d in ds_uc.iterdir() if d.is_dir()) == names
    for name in names:
        ours = torch.load(uc / name / "fp32.pt", weights_only=True)["param"]
        assert torch.equal(fp32[name][:ours.shape[0]], ours), name
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            ours = torch.load(uc / name / f"{state}.pt", weights_only=True)["param"]
            theirs = torch.load(ds_uc / name / f"{state}.pt", weights_only=False)["param"]
            assert torch.equal(theirs[:ours.shape[0]], ours), (name, state)
    assert (two / "ds_zero" / "latest").read_text().strip() == f"global_step{N}"
    print(f"--to deepspeed: zero_to_fp32 and ds_to_universal give the universal checkpoint's {len(names)} tensors "
          "(masters and moments) bit for bit")


@pytest.mark.multirank
def test_universal_checkpoint_into_an_engine_with_deepspeeds_scheduler(two):
    """The tp 2 engine above schedules with DeepSpeed's own scheduler, as the ds_config.json of
    `toolkit config` has it: the checkpoint puts it N steps in (its counter ``N - 1``), so from
    step N + 2 on its learning rate is the one an uninterrupted run of that engine uses; step
    N + 1 runs with the learning rate the checkpoint's parameter groups hold (the runtime's)."""
    resumed, whole = metrics(two / "uc_plain_tp2"), metrics(two / "plain_deepspeed_scheduler")
    runtime = metrics(two / slug("dp2 ZeRO-1"))
    assert json.loads((two / "uc_plain_tp2" / "scheduler_after_load.json").read_text()) == \
        {"last_batch_iteration": N - 1}
    assert [m["step"] for m in resumed] == list(range(N + 1, 2 * N + 1))
    assert [m["lr"] for m in resumed[1:]] == [m["lr"] for m in whole[N + 1:2 * N]]
    assert resumed[0]["lr"] == runtime[N]["lr"]
    print(f"universal -> engine with DeepSpeed's scheduler: lr at steps {N + 1}..{2 * N} "
          f"{[m['lr'] for m in resumed]}; uninterrupted DeepSpeed-scheduled run {[m['lr'] for m in whole]}; "
          f"runtime {[m['lr'] for m in runtime]}")


@pytest.mark.multirank
def test_deepspeeds_own_universal_checkpoint_resumes_in_the_runtime(two):
    """plain DeepSpeed run -> engine.save_checkpoint -> ds_to_universal -> runtime -> tp 2."""
    state = same_state(two / "plain" / "optim" / f"save_step{N}", two / "plain_resumed_tp2" / "optim" / f"load_step{N}")
    loss = continues(metrics(two / "plain"), metrics(two / "plain_resumed_tp2"), twin_of(two, ROUND_OFF[LLAMA]))
    print(f"plain DeepSpeed -> ds_to_universal -> runtime at tp2: {state}; steps {N + 1}..{2 * N} "
          f"max |loss diff| vs the plain run {loss}")


@pytest.mark.multirank
def test_megatron_lm_checkpoint_is_megatrons_distributed_optimizer_layout(two):
    """The written keys and shapes are exactly what DistributedOptimizer.sharded_state_dict asks
    for; megatron loads A's state bit for bit; megatron's own save resumes in the runtime."""
    from converters.formats import dcp

    asked = json.loads((two / "megatron" / "megatron_keys.json").read_text())
    written = {k: list(v.shape) for k, v in dcp.tensors(two / "mlm" / f"iter_{N:07d}").items()
               if k.startswith("optimizer.")}
    assert written == asked
    into = same_state(two.joinpath(*SAVED_A), two / "megatron" / "optim" / f"load_step{N}")
    back = same_state(two.joinpath(*SAVED_A), two / "megatron_resumed_tp2" / "optim" / f"load_step{N}")
    loss = continues(metrics(two / slug("dp2 ZeRO-1")), metrics(two / "megatron_resumed_tp2"),
                     twin_of(two, ROUND_OFF[LLAMA]))
    print(f"runtime -> megatron-lm: {len(written)} optimizer tensors, keys and shapes = megatron-core's; loaded by "
          f"its DistributedOptimizer: {into}; megatron's save -> runtime at tp2: {back}, steps {N + 1}..{2 * N} "
          f"max |loss diff| {loss}")


@pytest.mark.multirank
@pytest.mark.parametrize("name,says", [
    ("refuse_seed", "CheckpointMismatchError: the checkpoint's data order was shuffled with train.seed=1234"),
    ("refuse_model", "CheckpointMismatchError: "),
    ("refuse_seq_len", "CheckpointMismatchError: the checkpoint's samples are batch.seq_len=64 tokens and this "
                       "spec's batch.seq_len=32: its 24 samples consumed are not a position in this run's samples"),
    ("refuse_schedule", f"SchedulerMismatchError: the checkpoint's schedule decays over {2 * N} steps ({16 * N} "
                        f"samples), this run's over {2 * N + 2} steps ({16 * N + 16} samples): pass "
                        "--override-scheduler to use this run's, or --use-checkpoint-scheduler to keep the "
                        "checkpoint's\n"),
])
def test_what_cannot_carry_over_is_refused_in_one_line(two, name, says):
    message = (two / name / "error.txt").read_text()
    print(f"{name}: {message.strip()}")
    assert message.startswith(says) and message.count("\n") == 1
    assert not (two / name / "metrics.jsonl").exists()


@pytest.mark.multirank
def test_exit_interval_then_resume_is_the_uninterrupted_run(two):
    """6 steps planned, stopped after 3 (--exit-interval 3, saving there), resumed into the same
    folder: the losses and learning rates of all 6 steps are the uninterrupted run's."""
    whole, parts = metrics(two / slug("dp2 ZeRO-1")), metrics(two / "exit")
    assert [m["step"] for m in parts] == list(range(1, 2 * N + 1))
    assert [(m["loss"], m["lr"]) for m in parts] == [(m["loss"], m["lr"]) for m in whole]
    root = two / "exit" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"global_step{N}", f"global_step{2 * N}", "latest"]
    resumed = json.loads((two / "exit" / "worker.json").read_text())["resumed"]
    assert resumed == (f"resumed '{root / f'global_step{N}'}' at step {N} ({8 * N} samples consumed); learning rate: "
                       f"the checkpoint's schedule, the same as this run's (cosine decay over {2 * N} steps "
                       f"({16 * N} samples))")
    print(f"{resumed}\nlr of steps {N}, {N + 1}: {parts[N - 1]['lr']:.3e}, {parts[N]['lr']:.3e} (uninterrupted: "
          f"{whole[N - 1]['lr']:.3e}, {whole[N]['lr']:.3e})")


def samples(folder) -> dict[int, list[int]]:
    """{step: the dataset indices its micro-batches read on all ranks}; no index twice in a step."""
    steps: dict[int, list[int]] = {}
    for f in sorted(folder.glob("samples_rank*.json")):
        for step, ids in json.loads(f.read_text()).items():
            steps.setdefault(int(step), []).extend(ids)
    assert all(len(ids) == len(set(ids)) for ids in steps.values()), steps
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


@pytest.mark.multirank
def test_another_global_batch_reads_on_from_the_samples_consumed(two):
    """Global batch 8 for 2 steps, resumed at 16: steps 3 and 4 read samples 16..31 and 32..47
    (Megatron-LM's consumed_train_samples), and the step-4 checkpoint counts 48 samples in its
    position and in its learning-rate schedule."""
    first, then = samples(two / "batch8"), samples(two / "batch16")
    assert {k: first[k] for k in (1, 2)} == {1: list(range(0, 8)), 2: list(range(8, 16))}
    assert then == {3: list(range(16, 32)), 4: list(range(32, 48))}, then
    state = json.loads((two / "batch16" / "checkpoints" / "global_step4" / "train_state.json").read_text())
    assert (state["consumed_samples"], state["lr_scheduler"]["num_steps"], state["global_batch"]) == (48, 48, 16)
    resumed = json.loads((two / "batch16" / "worker.json").read_text())["resumed"]
    assert resumed.endswith("; global batch 16, the checkpoint's 8: the next step reads samples 16..31"), resumed
    assert "learning rate: this run's schedule (--override-scheduler; the checkpoint's decays over 4 steps " \
           "(32 samples), this run's over 4 steps (64 samples))" in resumed
    print(f"{resumed}\nsamples read per step: {then}")
