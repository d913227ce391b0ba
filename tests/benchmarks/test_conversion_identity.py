"""benchmarks/conversion_identity.py's comparison: torch files equal but for torch's random
serialization_id are the same; a changed tensor, a changed byte or a missing file is not."""
import torch

from benchmarks.conversion_identity import compare


def test_compare_sees_tensors_and_bytes_not_serialization_ids(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for root in (a, b):
        (root / "m").mkdir(parents=True)
        torch.save({"w": torch.arange(6.0)}, root / "m" / "model.pt")  # a new serialization_id each time
        (root / "m" / "config.json").write_text('{"x": 1}')
    assert compare(a, b) == (2, [])
    torch.save({"w": torch.arange(6.0) + 1e-7}, b / "m" / "model.pt")
    (b / "m" / "config.json").write_text('{"x": 2}')
    assert compare(a, b) == (2, ["m/config.json", "m/model.pt"])
    (b / "m" / "config.json").unlink()
    assert compare(a, b)[1][0].startswith("file lists differ")
