"""Make a baseline folder for benchmarks/ab_decode_kernel.py from a git revision, on this machine (the device
machine's .git is stale: build the folder here, it travels with the working tree as an untracked folder).

    python3 tools/ab_baseline.py 422710d ab/A                 # lowbit_decode.py + csrc/ of that revision
    python3 tools/ab_baseline.py 422710d ab/A2 --replace 'const bool CORR = B == 3' 'const bool CORR = false && B == 3'

The folder holds `lowbit_decode.py` and `csrc/` of the revision, with the extension renamed after the folder (two
builds side by side need distinct names); `--replace OLD NEW` replaces an exact fragment in every csrc file and fails
when it matches none (a variant without a commit of its own).
"""

from __future__ import annotations

import argparse
import io
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

MODULE = "src/moekv/ops/cuda/lowbit_decode.py"
CSRC = "src/moekv/ops/cuda/csrc"
EXT_NAME = "moekv_lowbit_decode_v7_sm"


def extension_name(folder: pathlib.Path) -> str:
    """A build name for the folder: letters, digits and underscores only."""
    return "moekv_ab_" + re.sub(r"[^0-9A-Za-z_]", "_", folder.name) + "_sm"


def make_baseline(rev: str, folder: pathlib.Path, replacements: list[tuple[str, str]], repo: pathlib.Path) -> None:
    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout

    module = git("show", f"{rev}:{MODULE}").decode()
    if EXT_NAME not in module:
        raise SystemExit(f"{rev}:{MODULE} does not name the extension {EXT_NAME!r}")
    if folder.exists():
        shutil.rmtree(folder)
    (folder / "csrc").mkdir(parents=True)
    (folder / "lowbit_decode.py").write_text(module.replace(EXT_NAME, extension_name(folder)))
    with tarfile.open(fileobj=io.BytesIO(git("archive", "--format=tar", rev, CSRC))) as tar:
        for member in tar.getmembers():
            if member.isfile():
                (folder / "csrc" / pathlib.Path(member.name).name).write_bytes(tar.extractfile(member).read())
    for old, new in replacements:
        hits = 0
        for path in (folder / "csrc").iterdir():
            text = path.read_text()
            if old in text:
                hits += text.count(old)
                path.write_text(text.replace(old, new))
        if hits == 0:
            raise SystemExit(f"--replace: {old!r} is in no csrc file of {rev}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("rev", help="git revision of the baseline kernel")
    ap.add_argument("folder", type=pathlib.Path, help="baseline folder to (re)create, e.g. ab/A")
    ap.add_argument("--replace", action="append", nargs=2, default=[], metavar=("OLD", "NEW"),
                    help="replace an exact fragment in the csrc files (repeatable)")
    ap.add_argument("--repo", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parents[1])
    args = ap.parse_args(argv)
    make_baseline(args.rev, args.folder, [tuple(pair) for pair in args.replace], args.repo)
    print(f"{args.folder}: {args.rev}, extension {extension_name(args.folder)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
