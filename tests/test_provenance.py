"""moekv.provenance: the commit a result records."""

from __future__ import annotations

import subprocess

from moekv import provenance


def test_override_wins(monkeypatch):
    monkeypatch.setenv("MOEKV_COMMIT", "abc1234")
    assert provenance.git_commit() == "abc1234"


def test_commit_of_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEKV_COMMIT", raising=False)
    run = dict(cwd=tmp_path, check=True, capture_output=True)
    subprocess.run(["git", "init", "-q"], **run)
    (tmp_path / "a.txt").write_text("1")
    subprocess.run(["git", "add", "a.txt"], **run)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], **run)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], text=True, **run).stdout.strip()
    assert provenance.git_commit(cwd=tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert provenance.git_commit(cwd=tmp_path) == head + "+uncommitted"
    assert provenance.git_commit(cwd=tmp_path, dirty_paths=["b.txt"]) == head


def test_outside_a_checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("MOEKV_COMMIT", raising=False)
    assert provenance.git_commit(cwd=tmp_path) is None
