"""tools/ab_baseline.py: a baseline folder of the decode kernel from a git revision, with its own extension name."""

import importlib.util
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("ab_baseline", ROOT / "tools" / "ab_baseline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _have_git() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


needs_git = pytest.mark.skipif(not _have_git(), reason="needs the repository's git history (a source tree without .git)")


@needs_git
def test_baseline_folder_from_head(tmp_path):
    tool = _tool()
    folder = tmp_path / "A2"
    tool.make_baseline("HEAD", folder, [("constexpr int RING_BUFS = 3;", "constexpr int RING_BUFS = 3;  // A2")], ROOT)
    module = (folder / "lowbit_decode.py").read_text()
    assert "moekv_ab_A2_sm" in module and "moekv_lowbit_decode_v7_sm" not in module
    names = {p.name for p in (folder / "csrc").iterdir()}
    assert {"lowbit_decode.cu", "lowbit_decode.cuh", "lowbit_decode_page.cuh"} <= names
    head = subprocess.run(["git", "-C", str(ROOT), "show", "HEAD:src/moekv/ops/cuda/csrc/lowbit_decode_page.cuh"],
                          check=True, capture_output=True, text=True).stdout
    assert (folder / "csrc" / "lowbit_decode_page.cuh").read_text() == head
    assert "RING_BUFS = 3;  // A2" in (folder / "csrc" / "lowbit_decode.cuh").read_text()


@needs_git
def test_a_replacement_that_matches_nothing_is_an_error(tmp_path):
    with pytest.raises(SystemExit, match="no csrc file"):
        _tool().make_baseline("HEAD", tmp_path / "A", [("no such fragment anywhere", "x")], ROOT)
