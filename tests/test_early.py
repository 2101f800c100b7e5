"""eval/early.py's choices without a GPU: which device an eval's argv starts early (none for cpu, --gpus, --help
or REVAL_EARLY=0), the hand-over of the cubin to rtc.py only for the device and architecture it was made for, a
thread that finds no driver ending quietly, and NVRTC's and torch's CUDA version found without importing torch.
The GPU path itself: tests/gpu/test_early_cuda.py."""
from __future__ import annotations

import subprocess
import sys
from concurrent.futures import Future

import pytest

from remote_payload.eval import cudac, early


@pytest.mark.parametrize("argv, index", [
    ([], 0), (["--device", "auto"], 0), (["--device", "cuda"], 0), (["--device", "cuda:3"], 3),
    (["--device=cuda:1"], 1), (["--device", "CPU"], None), (["--device", "cuda:x"], None),
    (["--gpus", "0,1"], None), (["--gpus=0,1"], None), (["--help"], None), (["-h"], None),
])
def test_the_device_an_eval_starts_early(argv, index, monkeypatch):
    monkeypatch.delenv("REVAL_EARLY", raising=False)
    assert early.device_index(["--drafter", "d", *argv]) == index


def test_reval_early_0_starts_nothing(monkeypatch):
    monkeypatch.setenv("REVAL_EARLY", "0")
    assert early.device_index(["--device", "cuda"]) is None


def test_the_cubin_goes_only_to_its_device_and_architecture(monkeypatch):
    fut: Future = Future()
    monkeypatch.setattr(early, "_job", {"index": 1, "cubin": fut})
    mine, wrong_arch = early.cubin(1, "sm_90"), early.cubin(1, "sm_80")
    assert early.cubin(0, "sm_90") is None  # no thread ran for device 0
    assert not mine.done()  # handed over before the thread is done: rtc.py waits on it when it loads
    fut.set_result(("sm_90", b"cubin", True, 0.01))
    assert mine.result() == (b"cubin", True, 0.01) and wrong_arch.result() is None


def test_a_thread_that_fails_resolves_to_none(monkeypatch):
    def boom(index):
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(early, "_start_device", boom)
    fut: Future = Future()
    early._run(0, fut)
    assert fut.result() is None


def test_without_a_driver_the_eval_process_starts_as_before():
    """A process without libcuda (this CPU machine): start() runs its thread, which ends with None, no error."""
    code = ("from remote_payload.eval import early; assert early.start(['--device', 'cuda']); "
            "print(early._job['cubin'].result(timeout=60)); import sys; print('torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0 and p.stdout.split() == ["None", "False"], p.stdout + p.stderr


def test_torch_cuda_version_is_read_without_importing_torch(tmp_path, monkeypatch):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.11.0'\ncuda: Optional[str] = '13.0'\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert cudac.torch_cuda_major() == "13"
    (tmp_path / "torch" / "version.py").write_text("cuda: Optional[str] = None\n")
    assert cudac.torch_cuda_major() is None


def test_nvrtc_is_looked_for_beside_torch_in_the_nvidia_wheels(tmp_path, monkeypatch):
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnvrtc.so.13").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert cudac.nvrtc_candidates("13") == ["libnvrtc.so.13", str(lib / "libnvrtc.so.13"), "libnvrtc.so"]
