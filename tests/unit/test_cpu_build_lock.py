"""kernels/cpu_build.build_lock: a build killed mid-way must not hang later processes.

torch's extension loader waits forever on a `lock` file in the build folder; a killed build leaves it
behind. build_lock holds an OS flock (released when its holder dies) and removes such a stale file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from radixlm.kernels.cpu_build import build_lock


def test_stale_torch_lock_file_is_removed(tmp_path: Path) -> None:
    (tmp_path / "lock").write_text("")
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_lock_of_a_killed_holder_is_released(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib; from radixlm.kernels.cpu_build import build_lock\n"
        f"p = pathlib.Path({str(tmp_path)!r})\n"
        "with build_lock(p):\n"
        "    (p / 'lock').write_text(''); print('held', flush=True); time.sleep(60)\n")],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with build_lock(tmp_path):        # blocks forever (pytest-timeout) if a dead holder's lock were kept
        assert not (tmp_path / "lock").exists()
