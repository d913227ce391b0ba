"""The torch.save files the converters write without torch, checked against torch itself:
the pickle is byte for byte torch.save's, every record sits where torch.save puts it,
torch.load reads the result (plain, mmap, and onto the meta device, where torch computes
record offsets from its own writer's geometry), zipfile finds every CRC-32 right, and the
zip64 fields of >4 GiB files are read by both."""
from __future__ import annotations

import argparse
import io
import os
import zipfile
import zlib

import pytest
import torch

from converters.dtypes import dtype_of
from converters.formats import torch_zip
from converters.formats.torch_pickle import TensorSpec


def _tensors():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(3, 4, generator=g).to(torch.bfloat16), torch.randn(5, generator=g), torch.zeros(0),
            torch.randn(2, 3, 4, generator=g).half(), torch.zeros(4, dtype=torch.float8_e4m3fn)]


def _checkpoint(tensors, dtype):
    args = argparse.Namespace(tensor_model_parallel_size=2, params_dtype=dtype, hf_config={"a": [1, 2.5, None]},
                              bf16=True, name="x")
    model = {"w": tensors[0], "w._extra_state": None, "b": tensors[1], "empty": tensors[2], "h": tensors[3],
             "f8": tensors[4]}
    return {"args": args, "checkpoint_version": 3.0, "iteration": 0, "model": model}


def _write(path, obj, reals) -> None:
    """Our layout, the records filled with the real tensors' bytes, CRC-32s patched in."""
    lay, specs = torch_zip.torch_file(obj, path.stem)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        torch_zip.write_pieces(fd, 0, lay)
        crcs = []
        for (off, n), t, spec in zip(lay.data, reals, specs):
            data = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            assert len(data) == n == spec.nbytes
            os.pwrite(fd, data, off)
            crcs.append(zlib.crc32(data))
        torch_zip.patch_crcs(fd, 0, lay, crcs)
    finally:
        os.close(fd)
    assert path.stat().st_size == lay.size


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_torch_loads_our_file_and_the_pickle_is_torch_saves(tmp_path):
    reals = _tensors()
    ours, theirs = tmp_path / "model_optim_rng.pt", tmp_path / "t" / "model_optim_rng.pt"
    theirs.parent.mkdir()
    _write(ours, _checkpoint([TensorSpec(tuple(t.shape), dtype_of(t.dtype)) for t in reals], dtype_of("bf16")), reals)
    want = _checkpoint(reals, torch.bfloat16)
    torch.save(want, theirs)
    zo, zt = zipfile.ZipFile(ours), zipfile.ZipFile(theirs)
    assert zo.testzip() is None
    assert [(i.filename, i.header_offset, i.file_size) for i in zo.infolist()][:-1] == \
        [(i.filename, i.header_offset, i.file_size) for i in zt.infolist()][:-1]  # all but the random id
    assert zo.read("model_optim_rng/data.pkl") == zt.read("model_optim_rng/data.pkl")
    raw = ours.read_bytes()
    for how in ({}, {"mmap": True}, {"map_location": "meta"}):
        with torch.serialization.safe_globals([argparse.Namespace]):
            got = torch.load(ours, weights_only=True, **how)
        assert vars(got["args"]) == vars(want["args"])
        for k, v in want["model"].items():
            if v is None:
                assert got["model"][k] is None
            elif how.get("map_location") == "meta":  # torch computed where the bytes are
                at = got["model"][k].untyped_storage()._checkpoint_offset
                assert raw[at:at + v.nbytes] == v.contiguous().view(torch.uint8).numpy().tobytes(), k
            else:
                assert _same(got["model"][k], v), k


def test_zip64_fields_are_read_by_torch_and_zipfile(tmp_path, monkeypatch):
    """Records and offsets past the limit (lowered here from 4 GiB) carry zip64 sizes and
    offsets in the local header, descriptor and central directory, and a zip64 end record."""
    monkeypatch.setattr(torch_zip, "ZIP64_LIMIT", 100)
    reals = _tensors()
    path = tmp_path / "big.pt"
    _write(path, _checkpoint([TensorSpec(tuple(t.shape), dtype_of(t.dtype)) for t in reals], dtype_of("bf16")), reals)
    assert b"PK\x06\x06" in path.read_bytes()  # the zip64 end of central directory record
    assert zipfile.ZipFile(path).testzip() is None
    for how in ({}, {"mmap": True}):
        with torch.serialization.safe_globals([argparse.Namespace]):
            got = torch.load(path, weights_only=True, **how)
        assert all(_same(got["model"][k], v) for k, v in _checkpoint(reals, None)["model"].items() if v is not None)


def test_object_files_equal_torch_saves_records(tmp_path):
    """common.pt and a ShardedObject's bytes: torch.save of objects without tensors."""
    obj = {"args": argparse.Namespace(a=1, params_dtype=dtype_of("fp16")), "iteration": 0}
    ours = zipfile.ZipFile(io.BytesIO(torch_zip.torch_bytes(obj, "common")))
    torch.save({"args": argparse.Namespace(a=1, params_dtype=torch.float16), "iteration": 0}, tmp_path / "common.pt")
    theirs = zipfile.ZipFile(tmp_path / "common.pt")
    assert ours.testzip() is None
    names = [n for n in theirs.namelist() if not n.endswith("serialization_id")]
    assert [n for n in ours.namelist() if not n.endswith("serialization_id")] == names
    assert all(ours.read(n) == theirs.read(n) for n in names)


def test_refusals():
    """torch_bytes is for objects without tensors; dtypes are the ones named in converters.dtypes."""
    with pytest.raises(ValueError):
        torch_zip.torch_bytes({"t": TensorSpec((2,), dtype_of("bf16"))})
    with pytest.raises(ValueError):
        dtype_of("complex32")


def test_records_past_4_gib_sit_where_torch_computes_them(tmp_path):
    """A 5 GiB record between small ones (zip64 sizes, offsets and 24-byte descriptors):
    torch.load onto the meta device computes where each record after the first starts from
    its own writer's geometry (miniz's headers, torch's padding), and finds ours there;
    zipfile reads the zip64 directory. The file is sparse: only the headers are written."""
    shapes = {"a": (7,), "big": ((5 << 30) // 2,), "b": (3,), "c": (5,)}
    dts = {"a": "fp32", "big": "bf16", "b": "fp16", "c": "fp32"}
    lay, _ = torch_zip.torch_file({"model": {k: TensorSpec(s, dtype_of(dts[k])) for k, s in shapes.items()}}, "x")
    fd = os.open(tmp_path / "x.pt", os.O_RDWR | os.O_CREAT)
    try:
        torch_zip.write_pieces(fd, 0, lay)  # the records' bytes stay holes
    finally:
        os.close(fd)
    assert [i.file_size for i in zipfile.ZipFile(tmp_path / "x.pt").infolist() if "/data/" in i.filename] == \
        [n for _, n in lay.data] == [28, 5 << 30, 6, 20]
    meta = torch.load(tmp_path / "x.pt", map_location="meta", weights_only=True)["model"]
    assert [meta[k].untyped_storage()._checkpoint_offset for k in shapes] == [off for off, _ in lay.data]
    assert lay.data[2][0] > 1 << 32  # the records after the big one start past 4 GiB
