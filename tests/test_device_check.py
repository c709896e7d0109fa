"""The device check's CPU smoke mode: ``benchmarks/device_check.py --device cpu --small`` runs every section on
the CPU, passes every gate and says it ran on the CPU (the GPU run itself needs a lent machine)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_device_check_cpu_smoke(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "device_check.py"), "--device", "cpu", "--small",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"

    result = json.loads((tmp_path / "device_check_cpu.json").read_text())
    assert result["device"] == "cpu" and result["small"] is True
    gates = {g["name"]: g for g in result["gates"]}
    # Each section reports its gates (a section that raises reports a failed "<section>.ran" gate instead).
    for name in ("env.num_threads_team", "env.no_vllm_import", "mirror.bytes_equal[512]", "mirror.bytes_equal[4096]",
                 "host_mirror.rows_equal", "host_mirror.ready",
                 "hash.mismatch_tf32_off", "merge.disjoint_equals_exact", "merge.empty_side_identity",
                 "merge.both_empty_zero", "decode[n=2048].segment_codes_roundtrip",
                 "decode[n=2048].segment_codes_vs_cpu_hash", "decode[n=2048,R=1].split_vs_single_call",
                 "decode[n=2048,R=4].split_vs_single_call", "decode[n=2048,R=1].all_dense_equals_exact",
                 "decode[n=2048,R=4].all_dense_equals_exact"):
        assert name in gates, f"gate {name} missing; got {sorted(gates)}"
    failed = [g for g in gates.values() if not g["passed"]]
    assert not failed, failed
    assert result["passed"] is True

    report = (tmp_path / "device_check_cpu.md").read_text()
    assert report.startswith("# Device check: device cpu")
    assert "CPU smoke mode, so none of them is a GPU figure" in report
    # Figures that only a GPU run measures (pinned copies, stream overlap) must not appear in a CPU report.
    assert "pinned GB/s" not in report and "overlap_fraction" not in json.dumps(result["mirror"])
