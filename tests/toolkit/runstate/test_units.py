"""Training-state conversion and resume checks without process groups (issue 16): the DCP record
copy against PyTorch's own DCP reader, the one-line refusals, and the CLI's bad-input paths.
The multi-rank checks against DeepSpeed and megatron-core are in tests/toolkit/runtime/test_resume_layouts.py."""
import json
import os
from pathlib import Path

import pytest
import torch

from converters.formats import dcp
from toolkit.cli import main
from toolkit.runstate import detect, megatron_lm
from toolkit.runtime import carry_over
from toolkit.runtime.optim_state import saved_step


def _save_dcp(folder: Path, tensors: dict) -> None:
    import torch.distributed.checkpoint as tdcp

    tdcp.save(tensors, storage_writer=tdcp.FileSystemWriter(str(folder)), no_dist=True)


def _load_dcp(folder: Path, like: dict) -> dict:
    import torch.distributed.checkpoint as tdcp

    out = {k: torch.empty_like(v) for k, v in like.items()}
    tdcp.load(out, storage_reader=tdcp.FileSystemReader(str(folder)), no_dist=True)
    return out


def test_select_copies_kept_records_that_torch_reads_back(tmp_path):
    g = torch.Generator().manual_seed(0)
    a = {"model.w": torch.randn(64, 32, generator=g), "optimizer.state.exp_avg.w": torch.randn(64, 32, generator=g)}
    b = {"optimizer.state.param.w": torch.randn(64, 32, generator=g).to(torch.bfloat16)}
    _save_dcp(tmp_path / "a", a)
    _save_dcp(tmp_path / "b", b)
    (tmp_path / "out").mkdir()
    copied = dcp.select([dcp.Source(tmp_path / "a", lambda k: k.startswith("model.")),
                         dcp.Source(tmp_path / "b", lambda k: True)], tmp_path / "out")
    kept = {"model.w": a["model.w"], "optimizer.state.param.w": b["optimizer.state.param.w"]}
    assert set(dcp.tensors(tmp_path / "out")) == set(kept)
    got = _load_dcp(tmp_path / "out", kept)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in kept.items())
    data = sum(f.stat().st_size for f in (tmp_path / "out").glob("*.distcp"))
    assert copied == data < sum(f.stat().st_size for d in "ab" for f in (tmp_path / d).glob("*.distcp"))


def test_select_refuses_a_folder_that_is_not_dcp(tmp_path):
    with pytest.raises(dcp.DCPError, match="is not a torch_dist checkpoint"):
        dcp.tensors(tmp_path)


W = carry_over.Wanted


def test_another_model_is_named_by_its_first_differing_tensor():
    stored = {"a": dcp.TensorInfo((4, 8), torch.float32), "emb": dcp.TensorInfo((640, 8), torch.float32)}
    assert carry_over.tensor_problem(Path("ck"), stored, [W("a", (4, 8), "0.a", False)]) is None
    assert "has no tensor 'b' (this model's 0.b" in carry_over.tensor_problem(
        Path("ck"), stored, [W("b", (4, 8), "0.b", False)])
    assert "'a' is [4, 8] there and [4, 16] in this model" in carry_over.tensor_problem(
        Path("ck"), stored, [W("a", (4, 16), "0.a", False)])
    # vocabulary padding may differ (megatron's allow_shape_mismatch), the hidden size may not
    assert carry_over.tensor_problem(Path("ck"), stored, [W("emb", (512, 8), "0.emb", True)]) is None
    assert carry_over.tensor_problem(Path("ck"), stored, [W("emb", (512, 16), "0.emb", True)]) is not None


def test_another_optimizer_and_another_data_order_are_refused():
    adam = {f"optimizer.state.{k}.w": None for k in ("param", "exp_avg", "exp_avg_sq")}
    sgd = {"optimizer.state.param.w": None, "optimizer.state.momentum_buffer.w": None}
    assert carry_over.optimizer_problem(Path("ck/optimizer"), adam) is None
    msg = carry_over.optimizer_problem(Path("ck/optimizer"), sgd)
    assert "no Adam moments" in msg and "momentum_buffer, param" in msg and "--load ck/model" in msg
    assert carry_over.data_problem({"seed": 1234}, 1234, 64) is None and carry_over.data_problem({}, 7, 64) is None
    assert "set train.seed=1234" in carry_over.data_problem({"seed": 1234}, 7, 64)


def test_step_from_megatron_param_groups():
    groups = {"optimizer": {"param_groups": [{"step": 30, "wd_mult": 1.0}, {"step": 30, "wd_mult": 0.0}]}}
    assert saved_step(groups) == 30 and saved_step({"step": 5}) == 5
    with pytest.raises(carry_over.CheckpointMismatchError, match="2 different steps"):
        saved_step({"optimizer": {"param_groups": [{"step": 1}, {"step": 2}]}})


def test_megatron_lm_dp_reshardable_is_refused_with_the_flag_to_use():
    with pytest.raises(Exception, match="--dist-ckpt-optim-fully-reshardable"):
        megatron_lm._flat_optimizer({"optimizer": {"param_groups": []}, "param_state_sharding_type": "dp_reshardable"})
    chained = {0: {"optimizer": {"param_groups": [{"step": 3}]}, "param_state_sharding_type": "fully_reshardable"},
               1: {"optimizer": {"param_groups": [{"step": 3, "is_expert_parallel": True}]},
                   "param_state_sharding_type": "fully_reshardable"}}
    flat = megatron_lm._flat_optimizer(chained)
    assert len(flat["optimizer"]["param_groups"]) == 2 and megatron_lm._optimizer_common(flat) == chained


def test_formats_are_recognised(tmp_path):
    (tmp_path / "run" / "global_step3").mkdir(parents=True)
    (tmp_path / "run" / "latest").write_text("global_step3")
    (tmp_path / "uc" / "zero").mkdir(parents=True)
    (tmp_path / "mlm").mkdir()
    (tmp_path / "mlm" / megatron_lm.TRACKER).write_text("3\n")
    assert [detect(tmp_path / d) for d in ("run", "uc", "mlm")] == ["runtime", "universal", "megatron-lm"]


def test_hf_trainer_folder_is_recognised_and_refused_as_a_source(tmp_path, capsys):
    hf = tmp_path / "hf"
    (hf / "global_step3" / "zero").mkdir(parents=True)
    (hf / "latest_universal").write_text("global_step3")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    assert detect(hf) == "hf"
    code, err = _cli(capsys, hf, tmp_path / "out", "--to", "runtime")
    assert code == 2 and "written here but not read" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(["convert", "run-state", *map(str, argv)])
    return code, capsys.readouterr().err


def test_cli_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys):
    code, err = _cli(capsys, tmp_path / "missing", tmp_path / "out", "--to", "universal")
    assert code == 3 and err == f"error: '{tmp_path / 'missing'}' does not exist\n"  # a missing input: exit 3
    half = tmp_path / "half" / "global_step3"  # a train_state.json but no model/ or optimizer/
    half.mkdir(parents=True)
    (half / "train_state.json").write_text(json.dumps({"step": 3, "consumed_samples": 48}))
    code, err = _cli(capsys, half, tmp_path / "out", "--to", "bogus")
    assert code == 2 and "unknown format 'bogus'" in err and err.count("\n") == 1
    code, err = _cli(capsys, half, tmp_path / "out", "--to", "universal")
    assert code == 1 and "is incomplete (no model/.metadata)" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half"]  # no output, no partial folder
    (tmp_path / "out").mkdir()
    code, err = _cli(capsys, half, tmp_path / "out", "--to", "universal")
    assert code == 1 and "already exists (pass --overwrite" in err


def test_reader_reads_what_megatron_reads_at_another_layout(tmp_path):
    """dcp.Reader (byte ranges into the caller's tensors) against the saved tensors and, where
    one process can load them (no layer axis), megatron's dist_checkpointing.load of the same
    requests, at another chunking than the one saved: a
    stacked key with a layer axis, a row range and a column block crossing stored chunks, a
    gated fc1 (megatron's swiglu factory), vocabulary padding only the request has
    (allow_shape_mismatch), fp32 stored and bf16 read, a vector; one process, no ranks."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from tests.support.megatron_save import save

    g = torch.Generator().manual_seed(0)
    emb, dense = torch.randn(10, 6, generator=g), torch.randn(3, 8, 12, generator=g)
    fc1, norm = torch.randn(8, 4, generator=g), torch.randn(7, generator=g)

    def pieces(key, t, grid):  # the global tensor saved as a grid of chunks
        out, sizes = [], [n // k for n, k in zip(t.shape, grid)]
        for idx in torch.cartesian_prod(*[torch.arange(k) for k in grid]).reshape(-1, len(grid)).tolist():
            part = t[tuple(slice(i * s, (i + 1) * s) for i, s in zip(idx, sizes))].clone()
            offsets = [(a, i, k) for a, (i, k) in enumerate(zip(idx, grid)) if k > 1]
            out.append(ShardedTensor.from_rank_offsets(key, part, *offsets))
        return out

    # chunks of (1, 4, 6) for the stacked key: what ranks holding one layer each write
    stored = {"emb": pieces("emb", emb, (2, 1)), "dense": pieces("dense", dense, (3, 2, 2)),
              "fc1": pieces("fc1", fc1, (4, 1)), "norm": pieces("norm", norm, (1,))}
    (tmp_path / "ck").mkdir()
    save(stored, tmp_path / "ck")

    def requests():  # rank 1 of a tp2 layout, the vocabulary padded to 12 rows
        fc1_part = ShardedTensor.from_rank_offsets("fc1", torch.empty(4, 4), (0, 1, 2))
        return {
            "emb": ShardedTensor.from_rank_offsets("emb", torch.empty(6, 6), (0, 1, 2), allow_shape_mismatch=True),
            "dense_rows": ShardedTensor.from_rank_offsets("dense", torch.empty(8, 6, dtype=torch.bfloat16), (0, 2, 3),
                                                          (2, 1, 2), prepend_axis_num=1),
            "dense_cols": ShardedTensor.from_rank_offsets("dense", torch.empty(4, 12), (0, 0, 3), (1, 1, 2),
                                                          prepend_axis_num=1),
            "dense_quarter": ShardedTensor.from_rank_offsets("dense", torch.empty(8, 3), (0, 1, 3), (2, 1, 4),
                                                             prepend_axis_num=1),  # columns 3..6 of a 6-column chunk
            "fc1": apply_swiglu_sharded_factory(fc1_part, ()),
            "norm": ShardedTensor.from_rank_offsets("norm", torch.empty(7)),
        }

    ours = requests()
    with dcp.Reader(tmp_path / "ck") as reader:
        for sh in ours.values():
            reader.fill(sh)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", 1), rank=0, world_size=1)
        try:
            theirs = {k: dist_checkpointing.load({k: sh}, str(tmp_path / "ck"), validate_access_integrity=False)[k]
                      for k, sh in requests().items() if not k.startswith("dense")}  # (one process: no layer axis)
        finally:
            dist.destroy_process_group()
    for k, t in theirs.items():
        assert torch.equal(ours[k].data, t) and ours[k].data.dtype == t.dtype, k
    assert torch.equal(ours["emb"].data[:4], emb[6:]) and not ours["emb"].data[4:].any()
    assert torch.equal(ours["fc1"].data, torch.cat([fc1[2:4], fc1[6:8]]))
    assert torch.equal(ours["dense_rows"].data, dense[2, :, 6:].bfloat16())
    assert torch.equal(ours["dense_cols"].data, dense[0, 4:])
    assert torch.equal(ours["dense_quarter"].data, dense[1, :, 3:6])
    assert torch.equal(ours["norm"].data, norm)

    # destinations outside host memory (CUDA parameters on a GPU; the meta device here, whose
    # tensors, like CUDA ones, cannot be viewed as numpy): filled through torch, whole and by rows
    with torch.device("meta"):
        on_meta = requests()
    with dcp.Reader(tmp_path / "ck") as reader:
        for sh in on_meta.values():
            reader.fill(sh)
            reader.fill(sh, (1, 2))
    assert all(sh.data.is_meta for sh in on_meta.values())

    missing = ShardedTensor.from_rank_offsets("emb", torch.empty(6, 6), (0, 1, 2))
    with dcp.Reader(tmp_path / "ck") as reader, pytest.raises(dcp.DCPError, match=r"'emb' is \[10, 6\]"):
        reader.fill(missing)

    # rows [start, stop) only (a resume reads just the rows of this rank's ZeRO fragment): those
    # rows as the whole read has them, every other element untouched; the gated factory's rows
    # cross from its gate half into its up half
    for k in ours:
        n = ours[k].data.shape[0]
        for rows in [(0, n), (1, n - 1), (n // 2 - 1, n // 2 + 1), (n - 1, n), (2, 2)]:
            part = requests()[k]
            part.data.fill_(-7.0)
            with dcp.Reader(tmp_path / "ck") as reader:
                reader.fill(part, rows)
            want = torch.full_like(ours[k].data, -7.0)
            want[rows[0]:rows[1]] = ours[k].data[rows[0]:rows[1]]
            assert torch.equal(part.data, want), (k, rows)

    # a readahead's plan (Reader.ranges) is every read fill then makes, byte for byte, and
    # making it changes no tensor; the readahead reads those ranges (merged) in file order
    reads: list = []
    real_preadv, real_sendfile = os.preadv, os.sendfile

    def preadv(fd, buffers, offset):
        n = real_preadv(fd, buffers, offset)
        reads.append((fd, offset, n))
        return n

    sent: list = []

    def sendfile(out_fd, in_fd, offset, count):
        n = real_sendfile(out_fd, in_fd, offset, count)
        sent.append((in_fd, offset, n))
        return n

    for k in ours:
        n = ours[k].data.shape[0]
        for rows in [None, (1, n - 1), (n // 2 - 1, n // 2 + 1), (2, 2)]:
            part = requests()[k]
            part.data.fill_(-7.0)
            with dcp.Reader(tmp_path / "ck") as reader:
                planned = reader.ranges([(part, rows)])
                assert (part.data == -7.0).all(), (k, rows)
                reads.clear()
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(os, "preadv", preadv)
                    reader.fill(part, rows)
                assert planned == reads and (rows == (2, 2)) == (not planned), (k, rows, planned, reads)
    with dcp.Reader(tmp_path / "ck") as reader:
        every = [(sh, rows) for k in ours for sh, rows in [(requests()[k], None), (requests()[k], (1, 3))]]
        planned = reader.ranges(every)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "sendfile", sendfile)
            asked = reader.readahead(every)
            reader._readahead.join()
        merged = dcp.merged_ranges(planned)
        assert sent == merged and asked == sum(n for _, _, n in merged) > 0
        assert [r[:2] for r in merged] == sorted(r[:2] for r in merged)
        assert all(any(f == fd and a <= at and at + n <= a + m for f, a, m in merged) for fd, at, n in planned)


def test_merged_ranges_and_cache(tmp_path, monkeypatch):
    import threading

    f = tmp_path / "data"
    f.write_bytes(bytes(range(256)) * 40)
    sent: list = []
    real = os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda out, fd, at, n: sent.append((at, n)) or real(out, fd, at, n))
    fd = os.open(f, os.O_RDONLY)
    try:
        dcp.cache([(fd, 0, 10_000), (fd, 10_100, 100)], piece=4096)
        assert sent == [(0, 4096), (4096, 4096), (8192, 1808), (10_100, 100)]
        stop, sent[:] = threading.Event(), []
        stop.set()  # what Reader.close does before waiting for the thread
        dcp.cache([(fd, 0, 10_000)], stop, piece=4096)
        assert sent == []
    finally:
        os.close(fd)
    assert dcp.merged_ranges([(4, 100, 10), (3, 0, 5), (4, 0, 50), (4, 60, 10), (3, 5, 0)], gap=10) == \
        [(3, 0, 5), (4, 0, 70), (4, 100, 10)]
    assert dcp.merged_ranges([(4, 0, 50), (4, 10, 5)], gap=0) == [(4, 0, 50)]
    assert dcp.merged_ranges([]) == []


def test_fragment_rows_cover_the_flat_range():
    """The rows a resume reads for a ZeRO fragment (flat elements [start, start + numel) of
    the tensor-parallel part) cover exactly the rows that range touches."""
    from toolkit.runtime.checkpoint import _fragment_rows

    shape = torch.Size([5, 4])
    assert _fragment_rows(None, shape) is None
    assert _fragment_rows((0, 0), shape) == (0, 0)
    assert _fragment_rows((0, 20), shape) == (0, 5)
    assert _fragment_rows((4, 8), shape) == (1, 3)
    assert _fragment_rows((3, 2), shape) == (0, 2)
    assert _fragment_rows((19, 1), shape) == (4, 5)
    assert _fragment_rows((3, 2), torch.Size([7])) == (3, 5)
    assert _fragment_rows((18, 4), shape) is None  # past the end: read all, DeepSpeed decides
    assert _fragment_rows((0, 1), torch.Size([])) is None


@pytest.mark.parametrize("cls,amsgrad", [(torch.optim.AdamW, False), (torch.optim.AdamW, True), (torch.optim.Adam, False)])
def test_prime_makes_the_state_a_zero_gradient_step_makes(cls, amsgrad):
    """optim_state's probe: every state entry a step at learning rate 0 on zero gradients
    creates (keys, dtypes, shapes, values), without stepping the parameters."""
    from toolkit.runtime import optim_state

    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, generator=g)), torch.nn.Parameter(torch.randn(3, 2, generator=g))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, stepped = (cls(ps, lr=1e-3, weight_decay=0.1, amsgrad=amsgrad) for ps in (params, twins))
    assert optim_state._state_from_probe(ours, params)
    with optim_state._zero_lr(stepped), optim_state._zero_grads(twins):
        stepped.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q) and p.grad is None
        a, b = ours.state[p], stepped.state[q]
        assert a.keys() == b.keys() and len(a) >= 3
        assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert not optim_state._state_from_probe(object(), params)


def test_state_files_are_torch_save_files_of_the_stored_values(tmp_path):
    """toolkit.runstate.torch_files writes what torch.save would: torch.load (plain and
    memory-mapped) reads the same values and entries, zipfile finds every CRC-32 right; from
    chunks split by rows (copied file to file) and by columns (gathered), the vocabulary
    padding rows left out, and an HF tensor cut out of a global one."""
    import zipfile

    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from toolkit.regions import whole
    from toolkit.runstate import torch_files

    from tests.support.megatron_save import save

    g = torch.Generator().manual_seed(0)
    emb, dense = torch.randn(12, 6, generator=g), torch.randn(4, 10, generator=g)
    prefix = "optimizer.state.exp_avg."
    stored = {"emb": [ShardedTensor.from_rank_offsets(prefix + "emb", emb[i * 6:(i + 1) * 6].clone(), (0, i, 2))
                      for i in range(2)],
              "dense": [ShardedTensor.from_rank_offsets(prefix + "dense", dense[:, i * 5:(i + 1) * 5].clone(),
                                                        (1, i, 2)) for i in range(2)],
              "other": ShardedTensor.from_rank_offsets("optimizer.state.param.emb", torch.zeros(12, 6))}
    (tmp_path / "ck").mkdir()
    save(stored, tmp_path / "ck")
    done = []
    with torch_files.StateSource(tmp_path / "ck", prefix) as source, torch_files.Writer() as writer:
        spec = torch_files.fp32((10, 6))  # 10 of the 12 stored rows: no padding
        obj = {"param": spec, "cat_dim": 0, "vocab_tensor": True}
        writer.save(tmp_path / "emb.pt", obj, spec, torch_files.global_copies(source, "emb", (10, 6)), source,
                    done.append)
        spec = torch_files.fp32((4, 10))
        writer.save(tmp_path / "dense.pt", {"param": spec, "cat_dim": 1}, spec,
                    torch_files.global_copies(source, "dense", (4, 10)), source, done.append)
        spec = torch_files.fp32((2, 3))  # rows 1-2, columns 4-6 of dense
        writer.save(tmp_path / "cut.pt", {"param": spec}, spec,
                    torch_files.hf_copies(source, [whole("dense", "cut", 2, 3, src_row=1, src_col=4)]), source,
                    done.append)
        with pytest.raises(Exception, match="does not hold all"):
            spec = torch_files.fp32((14, 6))
            writer.save(tmp_path / "more.pt", {"param": spec}, spec,
                        torch_files.global_copies(source, "emb", (14, 6)), source)
    assert sum(done) == 4 * (60 + 40 + 6)
    split = torch_files.StateSource.by_prefix(tmp_path / "ck", [prefix, "optimizer.state.param."])
    assert [set(s.keys) for s in split.values()] == [{"emb", "dense"}, {"emb"}]
    for s in split.values():
        s.close()
    want = {"emb.pt": ({"cat_dim": 0, "vocab_tensor": True}, emb[:10]), "dense.pt": ({"cat_dim": 1}, dense),
            "cut.pt": ({}, dense[1:3, 4:7])}
    for name, (extra, t) in want.items():
        for mmap in (False, True):
            got = torch.load(tmp_path / name, weights_only=True, mmap=mmap)
            assert list(got) == ["param", *extra] and {k: got[k] for k in extra} == extra
            assert got["param"].dtype == torch.float32 and torch.equal(got["param"], t), (name, mmap)
        with zipfile.ZipFile(tmp_path / name) as z:
            assert z.testzip() is None


def test_universal_to_runtime_writes_what_megatrons_save_writes(tmp_path, monkeypatch):
    """universal -> runtime streams every state file into torch_dist files; megatron's own
    dist_checkpointing.save of the same global tensors is the reference: the same keys, global
    shapes, dtypes, chunks and values (read back by PyTorch's DCP), with the vocabulary's
    padding rows zero, a bf16 moment cast to fp32, tensors stored as views into larger
    storages (as DeepSpeed's ds_to_universal saves a vocabulary without its padding), and at
    most MAX_OPEN + 1 state files open at a time (MAX_OPEN set to 3 here)."""
    from dataclasses import replace

    from toolkit.models import named_models, shape_from_hf
    from toolkit.runstate import universal
    from toolkit.runtime.optim_state import KEYS

    from tests.support.megatron_save import save, sharded_tensor

    config = {**named_models()["llama-tiny"]["config"], "vocab_size": 500}  # padded to 512
    shape = shape_from_hf(config)
    mm = universal.model_map(shape)
    tag = tmp_path / "uc" / "global_step7"
    g = torch.Generator().manual_seed(0)
    values = {}
    for name, gshape in mm.global_shapes.items():
        d = tag / "zero" / name
        d.mkdir(parents=True)
        for k in KEYS:
            rows = 500 if name in universal.VOCAB else gshape[0]
            t = torch.randn(rows + 3, *gshape[1:], generator=g)[3:]
            values[(k, name)] = t.bfloat16() if (k, name[-18:]) == ("exp_avg", "linear_proj.weight") else t
            torch.save({"param": values[(k, name)], "cat_dim": 0}, d / f"{universal.FILES[k]}.pt")
        torch.save(torch.tensor(7.0), d / "step.pt")
    torch.save({"param_groups": [{"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "params": [0]}]},
               tag / "zero" / "optimizer_state.pt")
    (tmp_path / "uc" / universal.LATEST).write_text(tag.name)

    monkeypatch.setattr(universal.StateFiles, "MAX_OPEN", 3)
    seen, queued = [], universal.StateFiles.queued
    monkeypatch.setattr(universal.StateFiles, "queued", lambda self, w: (seen.append(self.open_files),
                                                                          queued(self, w)))
    done = []
    folder = universal.universal_to_runtime(universal.find_tag(tmp_path / "uc"), tmp_path / "rt", config, done.append)
    assert folder == tmp_path / "rt" / "global_step7" and json.loads((folder / "train_state.json").read_text())["step"] == 7
    assert max(seen) == 4 and seen.count(4) > 10
    numel = sum(torch.Size(s).numel() for s in mm.global_shapes.values())
    assert sum(done) == 4 * numel * 4

    sizes = {"layer": shape.num_layers, "expert": 0}

    def whole(k, name):
        t, gshape = values[(k, name)].float(), mm.global_shapes[name]
        return torch.nn.functional.pad(t, (0, 0, 0, gshape[0] - t.shape[0])) if t.shape != gshape else t

    ref = {"model": {n: sharded_tensor(n, whole("param", n), 0, 0, s, True, sizes) for n, s in mm.global_shapes.items()},
           "optimizer": {}}
    for k in KEYS:
        for n, s in mm.global_shapes.items():
            sh = sharded_tensor(n, whole(k, n), 0, 0, s, True, sizes)
            ref["optimizer"][f"{k}/{n}"] = replace(sh, key=f"optimizer.state.{k}.{sh.key}")
    for part, state in ref.items():
        (tmp_path / f"ref_{part}").mkdir()
        save(state, tmp_path / f"ref_{part}")
        want, got = dcp.read_metadata(tmp_path / f"ref_{part}"), dcp.read_metadata(folder / part)
        tensors = {k: v for k, v in want.state_dict_metadata.items() if hasattr(v, "chunks")}
        assert set(tensors) == set(got.state_dict_metadata) and len(tensors) == (9 if part == "model" else 27)
        for key, w in tensors.items():
            o = got.state_dict_metadata[key]
            chunks = lambda md: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)  # noqa: E731
            assert (o.size, o.properties.dtype, chunks(o)) == (w.size, w.properties.dtype, chunks(w)), key
        like = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in tensors.items()}
        a, b = _load_dcp(tmp_path / f"ref_{part}", like), _load_dcp(folder / part, like)
        assert all(torch.equal(a[k], b[k]) for k in like)
    emb = _load_dcp(folder / "model", {"embedding.word_embeddings.weight": torch.empty(512, 64)})
    assert not emb["embedding.word_embeddings.weight"][500:].any()


class NotAllowed:
    """A class no weights-only load may build."""


def test_universal_files_allow_deepspeeds_classes_only_when_named(tmp_path):
    """A universal checkpoint's file loads weights-only; DeepSpeed's own classes (a loss
    scaler in a model-states file) are allowed when the pickle names them, anything else is
    refused in one line."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from toolkit.errors import InputFileError
    from toolkit.runstate import universal

    torch.save({"param": torch.arange(3.0)}, tmp_path / "plain.pt")
    torch.save({"global_steps": 3, "scaler": LossScaler(1.0)}, tmp_path / "ds.pt")
    torch.save({"other": NotAllowed()}, tmp_path / "other.pt")
    assert torch.equal(universal._load(tmp_path / "plain.pt")["param"], torch.arange(3.0))
    assert universal._load(tmp_path / "plain.pt", meta=True)["param"].is_meta
    assert isinstance(universal._load(tmp_path / "ds.pt")["scaler"], LossScaler)
    with pytest.raises(InputFileError, match="other.pt' is not a readable torch file"):
        universal._load(tmp_path / "other.pt")


def test_a_tensor_split_in_uneven_parts_is_refused_with_a_typed_error():
    """DeepSpeed's universal checkpoint splits a sub-parameter in equal parts; a gated delta net's
    fused projection (uneven parts over tp) cannot be described, and says so as a toolkit error."""
    from toolkit.errors import UnsupportedModelError
    from toolkit.models.weights import PARTS
    from toolkit.runstate.universal import entry

    with pytest.raises(UnsupportedModelError, match="uneven parts"):
        entry("decoder.layers.0.self_attention.in_proj.weight", PARTS, torch.zeros(4, 2))


SHM_PROBE = """
import json, os
from toolkit.mcore.cpu_compat import deepspeed_shm_segment
from toolkit.mcore.distributed import start_deepspeed_comm
from toolkit.runstate.deepspeed_zero import _one_process_world
with _one_process_world():
    segment = deepspeed_shm_segment(0)
    released = start_deepspeed_comm("gloo")
    print(json.dumps({"segment": str(segment), "released": released, "left": segment.exists()}))
"""


def test_the_deepspeed_files_conversion_leaves_no_shared_memory(python):
    """`--to deepspeed` starts deepspeed.comm in a world of its own process; on the CPU DeepSpeed's
    shared-memory all-reduce maps a 66 MB /dev/shm segment then and never unlinks it. The
    conversion unlinks it at once (it had been left behind by every conversion)."""
    import subprocess

    from tests.conftest import subprocess_env

    out = subprocess.run([python, "-c", SHM_PROBE], env=subprocess_env(), capture_output=True, text=True,
                         timeout=300, check=True).stdout
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["released"] is True and probe["left"] is False, probe
    assert not Path(probe["segment"]).exists()
