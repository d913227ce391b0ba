"""converters.formats.dcp_pickle writes DCP's ``.metadata`` without torch: byte for byte what
DCP's own ``FileSystemWriter.finish`` writes for the same records (DCP's classes built as
torch_dist_write built them before issue 44), for the records of real conversions (dense and
MoE, tp2 pp2, both with ``_extra_state`` bytes items) and for records mixing dtypes, ranks and
files; torch's reader and the torch-free one read it back."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import converters
from converters.formats import dcp, dcp_pickle, torch_dist_write

from tests.converters.formats.test_torch_unpickle import metadata_view
from tests.support.convert_models import make_hf

SAVE_ID = "0f0e0d0c-0b0a-4908-8706-050403020100"


def torch_metadata(d: Path, stored: list[list], monkeypatch) -> bytes:
    """The .metadata DCP's FileSystemWriter writes for these records (torch_dist_write's code
    before it stopped importing torch), with the save uuid fixed."""
    import torch.distributed.checkpoint.filesystem as fs
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)
    from torch.distributed.checkpoint.storage import WriteResult

    monkeypatch.setattr(fs, "_generate_uuid", lambda: SAVE_ID)
    state, results, base = {}, [], {}
    for name, key, offsets, sizes, global_shape, dtype, nbytes in stored:
        if offsets is None:
            state[key] = BytesStorageMetadata()
            index = MetadataIndex(key)
        else:
            md = state.setdefault(key, TensorStorageMetadata(
                TensorProperties(dtype=getattr(torch, dtype)), torch.Size(global_shape), []))
            md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            index = MetadataIndex(key, offsets)
        at = base.get(name, 0)
        results.append(WriteResult(index=index, size_in_bytes=nbytes, storage_data=_StorageInfo(name, at, nbytes)))
        base[name] = at + nbytes
    FileSystemWriter(str(d), sync_files=False).finish(Metadata(state_dict_metadata=state), [results])
    return (d / ".metadata").read_bytes()


def check_same(tmp_path: Path, stored: list[list], monkeypatch) -> None:
    ref, ours = tmp_path / "ref" / "release", tmp_path / "ours" / "release"
    ref.mkdir(parents=True)
    ours.mkdir(parents=True)
    want = torch_metadata(ref, stored, monkeypatch)
    got = dcp_pickle.metadata_bytes(stored, ref, save_id=SAVE_ID)  # the same folder name: it is in the pickle
    assert got == want
    dcp_pickle.write_metadata(ours, stored)
    assert sorted(p.name for p in ours.iterdir()) == [".metadata"]  # the .tmp renamed
    view = metadata_view(dcp.read_metadata(ours))
    assert view == metadata_view(dcp.read_plain_metadata(ours)) == metadata_view(dcp.read_metadata(ref))


@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_conversion_records_pickle_as_dcp_pickles_them(tmp_path, monkeypatch, name):
    seen = []
    monkeypatch.setattr(torch_dist_write, "write_metadata", lambda d, stored: seen.append(stored))
    hf = make_hf(name, tmp_path / "hf")
    converters.hf_to_megatron(hf, tmp_path / "mg", tp=2, pp=2, fmt="torch_dist", workers=2)
    stored = seen[0]
    assert any(r[2] is None for r in stored) and len({r[0] for r in stored}) == 2  # bytes items, 2 files
    monkeypatch.undo()
    check_same(tmp_path, stored, monkeypatch)


def test_mixed_records_pickle_as_dcp_pickles_them(tmp_path, monkeypatch):
    """dtypes in turn (the dtype globals referred back to), scalars' and vectors' shapes, offsets
    equal to sizes, a key's chunks in several files, bytes items between tensors."""
    stored = [["__0_0.distcp", "a", (0, 0), (2, 3), (4, 3), "bfloat16", 640],
              ["__0_0.distcp", "b", (0,), (5,), (5,), "float32", 600],
              ["__0_0.distcp", "x._extra_state/shard_0_2", None, (), (), None, 700],
              ["__0_1.distcp", "a", (2, 0), (2, 3), (4, 3), "bfloat16", 640],
              ["__0_1.distcp", "c", (1, 1, 0), (1, 1, 4), (2, 2, 4), "int64", 832],
              ["__0_1.distcp", "d", (), (), (), "float32", 512],
              ["__1_0.distcp", "b16", (0, 0), (0, 0), (0, 0), "float16", 512],
              ["__1_0.distcp", "x._extra_state/shard_1_2", None, (), (), None, 700],
              ["__1_0.distcp", "e", (3, 3), (3, 3), (6, 6), "bfloat16", 576]]
    check_same(tmp_path, stored, monkeypatch)


def test_version_is_dcps():
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    assert dcp_pickle.DCP_VERSION == CURRENT_DCP_VERSION
