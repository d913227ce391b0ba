"""ds_configs/ holds the generated DeepSpeed JSONs of every shipped example and recipe."""
from tools.sync_ds_configs import differences, shipped_specs


def test_ds_configs_in_sync():
    assert len(shipped_specs()) >= 3
    diff = differences()
    assert not diff, f"run `python tools/sync_ds_configs.py`; out of date: {sorted(diff)}"
