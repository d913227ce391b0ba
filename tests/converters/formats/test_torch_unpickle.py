"""converters.formats.torch_unpickle (issue 44: the megatron-to-hf path without ``import
torch``) against torch itself: for every rank file, common.pt and DCP record of checkpoints
the converters wrote (tp2 pp2, dense and MoE, both formats, ``_extra_state`` entries),
torch.save wrote (views, shared and non-contiguous storages, fp8 through
``_rebuild_tensor_v3``, scalars, empty tensors) and DCP's own ``save`` wrote, and (multirank)
megatron-core wrote, the torch-free reader gives exactly what ``torch.load(map_location=
"meta")`` + ``stored()`` give: every name, dtype, shape, stride and offset and every other
value; DCP's ``.metadata`` exactly what torch's FileSystemReader reads. Disallowed globals,
and files this reader was not written for, raise the typed error."""
from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import converters
from converters.errors import CorruptFileError
from converters.formats import dcp, torch_unpickle
from converters.formats.torch_pickle import ByteRange, load_plain, load_torch, stored
from converters.formats.torch_unpickle import NeedsTorch, PlainTensor, load_zip

from tests.support.convert_models import make_hf


# ---------------------------------------------------------------------------- what each reader sees
def _leaf(x):
    if isinstance(x, (torch.Tensor, PlainTensor)):
        shape = tuple(x.shape)
        strides = tuple(x.stride())
        try:
            s = stored(x, "t")
        except CorruptFileError:
            return ("non-contiguous", str(x.dtype), shape, strides)
        return ("tensor", str(s.dtype), s.shape, s.offset, strides)
    if isinstance(x, torch.dtype) or type(x).__name__ == "DType":
        return ("dtype", str(x))
    if isinstance(x, (str, int, float, bool, type(None), bytes)):
        return x
    if isinstance(x, io.BytesIO):
        return ("BytesIO", x.getvalue(), x.tell())
    raise AssertionError(f"unexpected leaf {type(x)}")


def flat(obj, prefix: str = "") -> dict:
    """Every leaf of a loaded object by its path: tensors as (dtype, shape, offset, strides)."""
    if isinstance(obj, argparse.Namespace):
        return {"ns:" + prefix: True, **flat(vars(obj), prefix)}
    if isinstance(obj, dict):
        out = {f"{prefix}#type": type(obj).__name__}
        for k, v in obj.items():
            out.update(flat(v, f"{prefix}/{k!r}"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {f"{prefix}#type": type(obj).__name__, f"{prefix}#len": len(obj)}
        for i, v in enumerate(obj):
            out.update(flat(v, f"{prefix}[{i}]"))
        return out
    return {prefix: _leaf(obj)}


def same_as_torch(path: Path) -> dict:
    """flat() of the torch-free read, asserted equal to torch's meta read; returned."""
    with open(path, "rb") as f:
        plain = flat(load_zip(f, str(path)))
    assert plain == flat(load_torch(path, str(path))), path
    return plain


def metadata_view(md) -> dict:
    """Everything dcp/torch_dist read from a DCP Metadata, in plain values."""
    keys = {}
    for k, v in md.state_dict_metadata.items():
        if type(v).__name__ == "BytesStorageMetadata":
            keys[k] = "bytes"
        else:
            p = v.properties
            keys[k] = (tuple(v.size), str(p.dtype), str(p.layout), p.requires_grad, p.pin_memory,
                       [(tuple(c.offsets), tuple(c.sizes)) for c in v.chunks])
    storage = {(i.fqn, None if i.offset is None else tuple(i.offset), i.index):
               (s.relative_path, s.offset, s.length, s.transform_descriptors) for i, s in md.storage_data.items()}
    plans = getattr(md, "all_local_plans", None) or []  # megatron-core's save adds them
    return {"keys": keys, "storage": storage, "version": getattr(md, "version", None),
            "planner_data": md.planner_data,
            "plans": [[(i.index.fqn, tuple(i.index.offset or ()), i.type.name) for i in p.items] for p in plans]}


def same_dcp_as_torch(folder: Path) -> int:
    """The torch-free metadata and every tensor record's start equal torch's; returns how
    many records were compared."""
    plain, theirs = dcp.read_plain_metadata(folder), dcp.read_metadata(folder)
    assert type(plain) is torch_unpickle.Metadata
    assert metadata_view(plain) == metadata_view(theirs)
    n = 0
    for idx, info in plain.storage_data.items():
        md = plain.state_dict_metadata[idx.fqn]
        with open(folder / info.relative_path, "rb") as f:
            record = ByteRange(f.fileno(), info.offset, info.length)
            if type(md).__name__ == "BytesStorageMetadata":
                continue
            ours = flat(load_plain(record, "r"))
            assert ours == flat(load_torch(record, "r")), (folder, idx.fqn)
            chunk = [c for c in md.chunks if tuple(c.offsets) == tuple(idx.offset)][0]
            start = dcp.record_start(f.fileno(), info, "r", tuple(chunk.sizes), md.properties.dtype, contiguous=False)
            t = load_torch(record, "r")
            want = info.offset + stored(t, "r").offset if t.is_contiguous() else None
            assert start == want
            n += 1
    return n


# ---------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """hf_to_megatron's checkpoints (megatron-core loads them: tests/converters/test_parity.py,
    test_moe.py): llama tp2 pp2 and qwen3_moe tp2 pp2 / ep2, both formats."""
    root = tmp_path_factory.mktemp("unpickle")
    out = {}
    for name in ("llama", "qwen3_moe"):
        hf = make_hf(name, root / name)
        layouts = [dict(tp=2, pp=2)] + ([dict(tp=1, pp=2, ep=2)] if name == "qwen3_moe" else [])
        for kw in layouts:
            for fmt in ("torch", "torch_dist"):
                tag = f"{name}-{fmt}-" + "-".join(f"{k}{v}" for k, v in kw.items())
                out[tag] = converters.hf_to_megatron(hf, root / tag, fmt=fmt, **kw)
    return out


def test_converted_rank_files_read_as_torch_reads_them(converted):
    files = [f for tag, d in converted.items() if "-torch-" in tag
             for f in sorted((d / "release").glob("mp_rank_*/model_optim_rng.pt"))]
    assert len(files) == 4 + 4 + 4
    seen = {}
    for f in files:
        seen.update({f"{f}:{k}": v for k, v in same_as_torch(f).items()})
    extra = [k for k, v in seen.items() if "._extra_state'" in k and v is None]
    experts = [k for k, v in seen.items() if ".experts." in k and isinstance(v, tuple) and v[0] == "tensor"]
    assert extra and experts and any(v == ("dtype", "torch.bfloat16") for v in seen.values())


def test_converted_torch_dist_read_as_torch_reads_it(converted):
    n = 0
    for tag, d in converted.items():
        if "-torch_dist-" in tag:
            n += same_dcp_as_torch(d / "release")
            same_as_torch(d / "release" / "common.pt")
    assert n > 40


def _odd_tensors() -> dict:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    return {
        "bf16": base.to(torch.bfloat16), "rows_view": base[2:5], "cols_view": base[:, 3:5], "transposed": base.t(),
        "shares_base": base, "scalar": torch.tensor(3.5), "empty": torch.zeros(0, 4), "int64": torch.arange(7),
        "f8": torch.zeros(4, 2, dtype=torch.float8_e4m3fn), "half": torch.randn(3, generator=g).half(),
        "expanded": torch.randn(1, 4, generator=g).expand(3, 4), "col": base[:, :1], "row_block": base[2:3, 1:4],
        "bool": base > 0,
        "layer._extra_state": None, "u8_extra_state": torch.tensor([1, 2, 3], dtype=torch.uint8),
    }


def test_torch_saved_tensors_read_as_torch_reads_them(tmp_path):
    """Views share one record at storage offsets; strides that are not contiguous (a
    transposed or expanded tensor, a column block; a size-1 dim's stride does not count)
    are seen as torch sees them."""
    f = tmp_path / "model_optim_rng.pt"
    args = argparse.Namespace(params_dtype=torch.bfloat16, tensor_model_parallel_size=2, hf_config={"a": [1, None]})
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, "model": _odd_tensors(),
                "list": [torch.ones(2), (torch.zeros(3), "x")]}, f)
    seen = same_as_torch(f)
    kinds = {k.split("/")[-1]: v[0] for k, v in seen.items() if isinstance(v, tuple)}
    assert {kinds[f"'{k}'"] for k in ("transposed", "expanded", "cols_view", "col")} == {"non-contiguous"}
    assert kinds["'rows_view'"] == kinds["'f8'"] == kinds["'row_block'"] == "tensor"  # (1, 3) of stride (8, 1)
    rows, whole = seen["/'model'/'rows_view'"], seen["/'model'/'shares_base'"]
    assert rows[3] == whole[3] + 2 * 8 * 4  # the same record, 2 rows of 8 float32 on


def test_dcp_saved_by_torch_reads_as_torch_reads_it(tmp_path):
    """DCP's own save (one process, no process group): tensors and a bytes item."""
    import torch.distributed.checkpoint as tdcp

    state = {k: v.contiguous() for k, v in _odd_tensors().items() if v is not None and v.numel()}
    state["extra"] = io.BytesIO(b"state")
    tdcp.save(state, storage_writer=tdcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert same_dcp_as_torch(tmp_path) == len(state) - 1


def test_stand_ins_have_torchs_fields():
    """A field DCP adds (or renames) in another torch version fails here, not in a read."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as m
    import torch.distributed.checkpoint.planner as p

    for ours, theirs in [(torch_unpickle.Metadata, m.Metadata), (torch_unpickle.StorageInfo, fs._StorageInfo),
                         (torch_unpickle.TensorStorageMetadata, m.TensorStorageMetadata),
                         (torch_unpickle.ChunkStorageMetadata, m.ChunkStorageMetadata),
                         (torch_unpickle.BytesStorageMetadata, m.BytesStorageMetadata),
                         (torch_unpickle.TensorProperties, m.TensorProperties),
                         (torch_unpickle.MetadataIndex, m.MetadataIndex),
                         (torch_unpickle.StorageMeta, m.StorageMeta), (torch_unpickle.SavePlan, p.SavePlan),
                         (torch_unpickle.WriteItem, p.WriteItem), (torch_unpickle.TensorWriteData, p.TensorWriteData),
                         (torch_unpickle.BytesIOWriteData, p.BytesIOWriteData)]:
        assert ours.FIELDS == tuple(f.name for f in dataclasses.fields(theirs)), theirs
    for ours, theirs in [(torch_unpickle.MemoryFormat, m._MEM_FORMAT_ENCODING),
                         (torch_unpickle.WriteItemType, p.WriteItemType)]:
        assert {e.name: e.value for e in ours} == {e.name: e.value for e in theirs}
    for (module, name), value in torch_unpickle.ALLOWED.items():
        if type(value).__name__ == "DType":
            assert getattr(torch, name) == value.torch
        elif module.startswith("torch") and module != "torch":
            assert hasattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name), (module, name)


def test_megatron_globals_are_megatrons():
    from megatron.core.safe_globals import SAFE_GLOBALS

    assert torch_unpickle.MEGATRON_GLOBALS == {f"{c.__module__}.{c.__qualname__}" for c in SAFE_GLOBALS}


def test_transformer_engine_extra_state_bytes_read_as_torch_reads_them(tmp_path):
    """TransformerEngine keeps a module's ``_extra_state`` as an io.BytesIO (Megatron-LM's
    allow-list has it); args may hold bytes (protocol 2: ``_codecs.encode``)."""
    f = tmp_path / "te.pt"
    extra = io.BytesIO(b"\x00fp8 meta\xff")
    extra.seek(3)
    torch.save({"args": argparse.Namespace(blob=b"\x01\x02"),
                "model": {"w": torch.ones(2, 3), "linear_qkv._extra_state": extra}}, f)
    seen = same_as_torch(f)
    assert seen["/'model'/'linear_qkv._extra_state'"] == ("BytesIO", b"\x00fp8 meta\xff", 3)
    assert seen["/'args'/'blob'"] == b"\x01\x02"


def test_pickle_naming_megatron_enum_is_read_by_torch(tmp_path):
    """Megatron-LM's own args hold its enums: only torch.load (with megatron's allow-list)
    builds them, so the plain reader hands the file over; the offsets are the same."""
    from megatron.core.transformer.enums import AttnBackend

    f = tmp_path / "m.pt"
    torch.save({"args": argparse.Namespace(attention_backend=AttnBackend.auto), "model": {"w": torch.ones(2, 3)}}, f)
    with open(f, "rb") as fh, pytest.raises(NeedsTorch, match="AttnBackend"):
        load_zip(fh, "m")
    got = load_plain(f, "m")
    assert isinstance(got["model"]["w"], torch.Tensor) and got["args"].attention_backend is AttnBackend.auto
    with open(f, "rb") as fh:
        records = {i.filename: i for i in zipfile.ZipFile(fh).infolist()}
    assert stored(got["model"]["w"], "w").offset > records["m/data/0"].header_offset


# ---------------------------------------------------------------------------- refusals
def _zip(path: Path, pkl: bytes, extra: dict[str, bytes] | None = None,
         compress: int = zipfile.ZIP_STORED) -> Path:
    with zipfile.ZipFile(path, "w", compression=compress) as z:
        z.writestr("archive/data.pkl", pkl)
        for name, data in (extra or {}).items():
            z.writestr(f"archive/{name}", data)
    return path


def test_disallowed_global_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    evil = f"cos\nsystem\n(S'touch {marker}'\ntR.".encode()
    f = _zip(tmp_path / "evil.pt", evil)
    with pytest.raises(CorruptFileError, match="'os.system', which is not allowed"):
        load_plain(f, "evil")
    with pytest.raises(CorruptFileError):  # and torch's weights_only refuses it too
        load_torch(f, "evil")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".metadata").write_bytes(evil)
    with pytest.raises(dcp.DCPError, match="os.system"):
        dcp.read_plain_metadata(tmp_path / "d")
    # a builtin torch may allow is torch's to judge: eval it does not
    f = _zip(tmp_path / "eval.pt", b"cbuiltins\neval\n(S'1'\ntR.")
    with pytest.raises(CorruptFileError):
        load_plain(f, "eval")
    assert not marker.exists()


def test_files_this_reader_was_not_written_for_are_refused(tmp_path):
    buf = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buf)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as z:
        records = {i.filename.split("/", 1)[1]: z.read(i) for i in z.infolist()}
    pkl = records.pop("data.pkl")
    with open(_zip(tmp_path / "ok.pt", pkl, records), "rb") as f:
        assert load_zip(f, "ok")["w"].shape == (4,)
    for name, edit, compress, match in [
            ("big", {"byteorder": b"big"}, zipfile.ZIP_STORED, "byteorder 'big'"),
            ("ver", {"version": b"9\n"}, zipfile.ZIP_STORED, "version '9'"),
            ("fmt", {".format_version": b"2"}, zipfile.ZIP_STORED, "format_version '2'"),
            ("zip", {}, zipfile.ZIP_DEFLATED, "compressed"),
            ("short", {"data/0": b"\0" * 8}, zipfile.ZIP_STORED, "holds 8 bytes")]:
        with open(_zip(tmp_path / f"{name}.pt", pkl, {**records, **edit}, compress), "rb") as f, \
                pytest.raises(CorruptFileError, match=match):
            load_zip(f, name)
    with pytest.raises(CorruptFileError, match="not a zip file"):
        load_plain(io.BytesIO(b"\x80\x02}q\x00."), "old")


def test_dcp_field_this_reader_does_not_know_is_refused(tmp_path):
    pkl = (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n)\x81}(X\x13\x00\x00\x00state_dict_metadata"
           b"}X\x08\x00\x00\x00new_onesK\x01ub.")
    (tmp_path / ".metadata").write_bytes(pkl)
    with pytest.raises(dcp.DCPError, match=r"Metadata is pickled with \['new_ones', 'state_dict_metadata'\]"):
        dcp.read_plain_metadata(tmp_path)


# ---------------------------------------------------------------------------- the CLI imports
def test_megatron_to_hf_imports_no_torch(converted, tmp_path):
    """A fresh interpreter exports a tiny legacy and a tiny torch_dist checkpoint: torch is never
    imported (tests/converters/test_imports.py's probe), and the files are what the in-process
    export (which this test process's torch may be loaded for) writes."""
    from tests.converters.test_imports import heavy_imports

    legacy, dist = converted["llama-torch-tp2-pp2"], converted["llama-torch_dist-tp2-pp2"]
    out = [tmp_path / "from-legacy", tmp_path / "from-dist"]
    assert heavy_imports(["convert", "megatron-to-hf", str(legacy), str(out[0])],
                         ["convert", "megatron-to-hf", str(dist), str(out[1])]) == ([0, 0], [])
    for src, got in zip((legacy, dist), out):
        want = converters.megatron_to_hf(src, tmp_path / f"want-{got.name}")
        assert sorted(os.listdir(got)) == sorted(os.listdir(want))
        assert (got / "model.safetensors").read_bytes() == (want / "model.safetensors").read_bytes()


def test_plan_shards_splits_as_huggingface_hub_splits_meta_tensors():
    from huggingface_hub import split_torch_state_dict_into_shards

    from converters.dtypes import bfloat16, float32
    from converters.formats.hf import plan_shards
    from converters.stream import Target

    shapes = [(512, 64), (64,), (192, 64), (64, 64), (3, 5), (1000, 64), (64,), (0, 4)]
    targets = [Target(f"t{i}", s, float32 if i % 2 else bfloat16, ()) for i, s in enumerate(shapes)]
    for size in (10_000, 70_000, 1 << 30):
        meta = {t.name: torch.empty(t.shape, dtype=t.dtype.torch, device="meta") for t in targets}
        want = split_torch_state_dict_into_shards(meta, filename_pattern="model{suffix}.safetensors",
                                                  max_shard_size=size).filename_to_tensors
        got = {f: [t.name for t in ts] for f, ts in plan_shards(targets, size).items()}
        assert got == want and (len(got) > 1) == (size < 1 << 30)


# ---------------------------------------------------------------------------- megatron-core's own files
@pytest.mark.multirank
def test_checkpoints_megatron_core_wrote(tmp_path):
    """megatron-core saves a dense model at tp=2 and a MoE model at ep=2 itself (2 ranks,
    dist_checkpointing.save and each rank's state_dict(): tests/support/convert_megatron_writer.py):
    both formats read without torch as torch reads them."""
    from tests.support.convert_checks import launch, writer_jobs

    jobs = writer_jobs(tmp_path, ["llama"], [{"tp": 2}]) + writer_jobs(tmp_path, ["qwen3_moe"], [{"tp": 1, "ep": 2}])
    launch(tmp_path, [], jobs, nproc=2)
    files = 0
    for job in jobs:
        out = Path(job["out"])
        for f in sorted((out / "legacy").rglob("model_optim_rng.pt")):
            same_as_torch(f)
            files += 1
        assert same_dcp_as_torch(out / "dist") > 10
        if (out / "dist" / "common.pt").is_file():
            same_as_torch(out / "dist" / "common.pt")
    assert files == 4
