"""scripts/ffn_part_cost.py runs the FFN rank's per-part path over real shm links and prints its CPU per part."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_it_prints_each_half_s_cpu_per_part_for_every_union_size():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "ffn_part_cost.py"), "--attention-ranks", "1,3", "--unions", "20"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    rows = [r for r in (line.split() for line in res.stdout.splitlines()) if len(r) == 9 and r[2::2] == ["us"] * 4]
    assert [r[0] for r in rows] == ["1", "3"], res.stdout
    assert all(float(v) > 0 for r in rows for v in r[1::2][:4]), res.stdout
