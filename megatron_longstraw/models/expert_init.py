"""Initial weights that do not depend on the CP / EP layout: the same `--seed` gives every
parameter the same initial value at EP 1, 2, 4, ... and any CP size.

Megatron draws every weight from torch's CPU generator in build order
(`use_cpu_initialization`, models/config_files.py). An EP rank builds only its num_experts / EP
routed experts, so before this module (a) rank e's experts were drawn where rank 0's are drawn,
and (b) every layer built after the first MoE layer (attention, router, shared experts, output
layer) drew from a stream that had advanced by a layout-dependent amount. Two pieces fix both:

- `experts_off_stream(builder)` wraps the MoE spec's experts builder (models/mla_spec.py) so that
  building the local experts leaves the CPU (and the current CUDA) generator as it found it: the
  non-expert parameters are then drawn in the same order from the same stream on every layout,
  identically on every rank (all ranks seed it with `--seed`).
- `seed_experts(model, seed)` (models/common.py's `build_hybrid_model`, after the build) redraws
  every routed expert's weights from its own generator, seeded by (seed, the parameter's global
  name): `decoder.layers.<l>.mlp.experts.local_experts.<global expert>.linear_fc{1,2}.weight`.
  The draw is the one Megatron makes (`_initialize_affine_weight_cpu`): the module's
  `init_method` (fc1) or `output_layer_init_method` (fc2) on a float32 CPU tensor, then cast
  to the parameter's dtype and device; so the distribution is unchanged and the value is the
  same on CPU and GPU. Cost: the routed experts are drawn twice at build time (once by Megatron,
  discarded), on the CPU.

Loaded weights (--load, --pretrained-checkpoint) replace all of this; it only decides the random
initialisation (demos, tests, runs from scratch). tests/test_init_layout.py compares the gathered
state dicts of EP1, EP2, CP2 bitwise.
"""

from __future__ import annotations

import functools
import hashlib
import re

import torch

from megatron_longstraw.distributed.expert_names import global_name
from megatron_longstraw.runtime import platform

_EXPERT_MODULE = re.compile(r"(^|\.)local_experts\.\d+$")


def experts_off_stream(builder):
    """`builder` (an experts ModuleSpec builder: SequentialMLP partial) with the RNG states it
    consumes restored afterwards (the experts' values come from `seed_experts`)."""

    @functools.wraps(builder)
    def build(*args, **kwargs):
        devices = [torch.cuda.current_device()] if platform.has_cuda() else []
        with torch.random.fork_rng(devices=devices):
            return builder(*args, **kwargs)

    return build


def expert_seed(seed: int, name: str) -> int:
    """The generator seed of the parameter `name` (global name) for `--seed` `seed`: 63 bits of
    sha256, so that nearby seeds and names give unrelated streams."""
    digest = hashlib.sha256(f"{int(seed)}|{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_experts(model: torch.nn.Module, seed: int) -> int:
    """Redraw every routed expert's linear weights of `model` (this rank's local experts) from
    generators seeded by (seed, global parameter name). Returns the number of tensors drawn.
    Raises on an expert parameter it does not know how to draw unless it holds one constant
    value (biases: zeros), which is layout-independent already."""
    cfg = getattr(model, "longstraw_config", None)
    num_experts = getattr(cfg, "n_routed_experts", 1) if cfg is not None else 1
    drawn = 0
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not _EXPERT_MODULE.search(module_name):
                continue
            config = module.config
            if not config.perform_initialization:
                continue
            inits = {"linear_fc1.weight": config.init_method,
                     "linear_fc2.weight": config.output_layer_init_method}
            for name, param in module.named_parameters():
                full = global_name(f"{module_name}.{name}", num_experts)
                if name not in inits:
                    flat = param.detach().reshape(-1)
                    if flat.numel() and not bool((flat == flat[0]).all()):
                        raise RuntimeError(
                            f"{full}: a randomly initialised expert parameter that "
                            "models/expert_init.py does not redraw; add its init there.")
                    continue
                value = torch.empty(param.shape, dtype=torch.float32)
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(expert_seed(seed, full))  # CPU only
                    inits[name](value)
                param.copy_(value)
                drawn += 1
    return drawn
