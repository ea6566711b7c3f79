"""Megatron-style entry point for LongStraw GRPO post-training.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py --longstraw \
        --longstraw-config examples/glm52/full.yaml \
        --context-parallel-size 8 --expert-model-parallel-size 8 \
        --train-iters 100 --lr 1e-6 --clip-grad 1.0 --bf16 \
        --longstraw-data groups.jsonl --longstraw-tokenizer /path/to/tokenizer \
        --save ckpt --save-interval 10 --tensorboard-dir tb

Megatron's model and parallel flags are parsed by megatron.training's own parser; the
`--longstraw-*` flags come from one extra_args_provider (megatron_longstraw.training.arguments). To add the
same switch to Megatron-LM's own pretrain_gpt.py, apply patches/megatron-lm-pretrain_gpt-longstraw.patch (re-base it on your Megatron-LM
checkout: see its header).

A user error (a bad flag, config value or data line, a missing input, a checkpoint that does not
fit: megatron_longstraw/runtime/errors.py) ends the run with one line naming the cause and where, printed
once by rank 0, and exit code 2; anything else is a bug and keeps its traceback.
"""

# First, before the heavy imports: under torchrun, a worker whose launcher dies stops, even while
# it still imports (megatron_longstraw/runtime/parent_watch.py).
from megatron_longstraw.runtime.parent_watch import watch_parent

watch_parent()

from megatron_longstraw.training.train import cli  # noqa: E402

if __name__ == "__main__":
    cli()
