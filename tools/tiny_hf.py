#!/usr/bin/env python
"""Write a small Hugging Face checkpoint with random weights, for trying the tools without a
download (the README's walkthrough starts from it):

    python tools/tiny_hf.py --family glm52 --out tiny-hf            # examples/glm52/tiny.yaml
    python tools/tiny_hf.py --family qwen36 --config my.yaml --out tiny-hf

The model is the `model:` section of `--config` (default: the family's tiny YAML) as transformers
builds it (`GlmMoeDsaForCausalLM`, `Qwen3_5ForCausalLM`, `DeepseekV3ForCausalLM`), initialised by
transformers from `--seed`, saved with `save_pretrained` in float32 (config.json +
model.safetensors): the same files a released checkpoint has, so tools/convert_hf.py reads it as
it reads one (megatron_longstraw/checkpointing/hf.py `write_random_hf`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatron_longstraw.checkpointing.hf import ConversionError, write_random_hf  # noqa: E402
from megatron_longstraw.models.registry import FAMILIES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--config", type=Path, default=None,
                        help="Model YAML (its `model:` section); default: the family's tiny.yaml.")
    parser.add_argument("--out", required=True, type=Path,
                        help="Hugging Face directory to write (new or empty).")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    family = FAMILIES[args.family]
    config = args.config or REPO / family.tiny_config
    try:
        summary = write_random_hf(family, family.config_class.from_yaml(config), args.out,
                                  args.seed)
    except (ConversionError, FileNotFoundError, ValueError) as exc:
        sys.exit(f"tiny_hf.py: error: {exc}")
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
