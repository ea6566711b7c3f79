"""Model-family-independent access to a Megatron `HybridModel`: embedding, decoder layers grouped the
way the model's checkpoints define a layer (one mixer symbol plus the FFN symbols after it), and the
LM head. Capture and replay drive the model through these, layer by layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_longstraw.models.expert_init import seed_experts
from megatron_longstraw.runtime import platform
from megatron_longstraw.runtime.patches.layer_state import release_call_state
from megatron_longstraw.state.attention_pass import AttentionPass

MIXERS = {"M", "G", "*", "D", "+"}  # symbols that read other tokens (attention / recurrence)


def decoder_groups(model) -> list[list[torch.nn.Module]]:
    """Stack layers grouped per decoder layer: `D-` / `DE` (GLM-5.2), `G-` / `*-` (Qwen3.6)."""
    groups: list[list[torch.nn.Module]] = []
    for symbol, layer in zip(model.decoder.layer_type_list, model.decoder.layers):
        if symbol in MIXERS or not groups:
            groups.append([])
        groups[-1].append(layer)
    return groups


def is_mixer(layer) -> bool:
    return hasattr(layer, "self_attention") and not _is_identity(layer.self_attention)


def mixer_of(group):
    """The mixer module (`self_attention`) of a decoder layer's group."""
    return next(layer.self_attention for layer in group if is_mixer(layer))


def selection_kinds(model) -> set[str]:
    """Page kinds that only feed a discrete selection (DSA index keys): no prompt gradient."""
    return {kind for group in decoder_groups(model)
            for kind in getattr(mixer_of(group), "selection_kinds", ())}


def _is_identity(module) -> bool:
    return type(module).__name__ == "IdentityOp"


def run_layer(layer, hidden: torch.Tensor, state: AttentionPass | None) -> torch.Tensor:
    """One HybridStack layer on [s, 1, h] in the pass `state` (Megatron's `attention_mask`, read by
    the mixers; None: a plain full-sequence forward). What the layer keeps of the call is released
    after it (patches/layer_state.py), also when a checkpoint's recompute stops inside it."""
    try:
        out = layer(hidden_states=hidden, attention_mask=state)
    finally:
        release_call_state(layer)
    return out[0] if isinstance(out, tuple) else out


def run_group(group, hidden: torch.Tensor, state: AttentionPass | None,
              chunk_sizes: list[int] | None = None) -> torch.Tensor:
    """One decoder layer in the pass `state` (`run_layer`). FFN/MoE symbols are token-wise: with
    `chunk_sizes` (rows per chunk, summing to the rows of `hidden`: capture's token blocks) they
    run chunk by chunk, so their intermediates (MoE dispatch buffers, FFN activations) stay
    O(chunk). Under EP every rank must pass as many chunks (each MoE call is a collective)."""
    for layer in group:
        if is_mixer(layer) or chunk_sizes is None or len(chunk_sizes) <= 1:
            hidden = run_layer(layer, hidden, state)
        else:
            hidden = torch.cat([run_layer(layer, chunk, state)
                                for chunk in hidden.split(chunk_sizes)])
    return hidden


def embed(model, input_ids: torch.Tensor) -> torch.Tensor:
    """input_ids [s] -> hidden [s, 1, h]."""
    return model.embedding(input_ids=input_ids[None, :], position_ids=None)


HEAD_CHUNK_ROWS = 1024
"""Rows of the LM head's logits formed at once by `head_logprobs` (its default `chunk_rows`). The
head's forward + backward peaks at about three fp32 [chunk_rows, vocab] tensors (logits,
log-softmax, its gradient; 3.0-3.1x measured on CPU for fp32 and bf16 weights, weight gradients
aside): at Qwen3.6's 248,320 tokens and 1024 rows about 2.8 GiB, whatever the response length."""


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """Final norm + output layer. hidden [s, 1, h] -> logits [s, vocab] (float32 or wider). Forms
    all s rows at once: for a few rows (decode's G samples); `head_logprobs` chunks the rows."""
    hidden = model.decoder.final_norm(hidden)
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    logits, _ = model.output_layer(hidden, weight=weight)
    return logits[:, 0].to(torch.promote_types(logits.dtype, torch.float32))


def head_logprobs(model, hidden: torch.Tensor, targets: torch.Tensor,
                  chunk_rows: int = HEAD_CHUNK_ROWS) -> torch.Tensor:
    """`head_logits` + log-softmax at the targets, `chunk_rows` rows at a time
    (`head_logprobs_entropy`). hidden [s, 1, h], targets [s] -> [s] (float32 or wider)."""
    return head_logprobs_entropy(model, hidden, targets, chunk_rows)[0]


def head_logprobs_entropy(model, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk_rows: int = HEAD_CHUNK_ROWS, with_entropy: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of the targets and, with `with_entropy`, the entropy of the policy's next-token
    distribution (no autograd), walking the rows in chunks of `chunk_rows` so that the
    [rows, vocab] logits exist for one chunk at a time, in the forward and in the backward.
    hidden [s, 1, h], targets [s] (int64) -> (log-probs [s], entropy [s] or None), float32 or wider.

    Each chunk runs `head_logits` (final norm + output layer, through the modules themselves, so a
    tied embedding weight or a LoRA-wrapped output layer is used exactly as in the unchunked head),
    log-softmax and gather. Under autograd every chunk is a non-reentrant checkpoint: the forward
    keeps only the chunk's input rows (views of `hidden`: O(s x h) in all) and its [c] log-probs;
    the backward recomputes that chunk's logits (the checkpoint restores the RNG state, so LoRA
    dropout draws the same mask) and frees them before the next chunk (autograd runs the chunks'
    nodes in reverse creation order, one chunk after the other). Results are those of one
    `log_softmax(head_logits(...))` gather: the norm, the matmul and the softmax are row-wise, so
    chunking changes which rows share a kernel call, not what a row computes; gradients reach
    `hidden`, the final norm, the output (or shared embedding) weight and any adapters by plain
    autograd. The price is one more head forward in the backward.

    Tensor parallelism is always 1 here (the mixers refuse TP > 1), so the output layer holds the
    whole vocabulary and there is no vocab-parallel softmax."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive number of rows, got {chunk_rows}.")
    # None after the forward: a backward's recompute of a chunk does not compute the entropy again
    sink = {"entropy": [] if with_entropy else None}

    def chunk_logprobs(hidden_chunk: torch.Tensor, targets_chunk: torch.Tensor) -> torch.Tensor:
        logprobs = F.log_softmax(head_logits(model, hidden_chunk), dim=-1)      # [c, vocab]
        if sink["entropy"] is not None:
            with torch.no_grad():   # p log p in place: one [c, vocab] beside the log-probs
                sink["entropy"].append(-logprobs.exp().mul_(logprobs).sum(-1))  # [c]
        return logprobs.gather(-1, targets_chunk[:, None]).squeeze(-1)         # [c]

    checkpointed = torch.is_grad_enabled()
    picked = [checkpoint(chunk_logprobs, h, t, use_reentrant=False) if checkpointed
              else chunk_logprobs(h, t)
              for h, t in zip(hidden.split(chunk_rows), targets.split(chunk_rows))]
    entropy = torch.cat(sink["entropy"]) if with_entropy else None
    sink["entropy"] = None
    return torch.cat(picked), entropy


def build_hybrid_model(cfg, tcfg, stack_spec, params_dtype: torch.dtype):
    """A Megatron `HybridModel` for a family config `cfg` (vocab, positions, pattern, tying) with
    RoPE applied inside the mixers at true positions, its routed experts drawn independently of
    the EP layout (models/expert_init.py), cast to one dtype (Megatron's local norms
    ignore params_dtype; Megatron's Float16Module casts the same way for bf16)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    model = HybridModel(
        config=tcfg,
        hybrid_stack_spec=stack_spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        hybrid_layer_pattern=cfg.hybrid_layer_pattern(),
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        position_embedding_type="none",
    )
    model.longstraw_config = cfg
    seed_experts(model, platform.init_seed())   # routed experts by (seed, global name)
    model.to(dtype=params_dtype)
    return model
