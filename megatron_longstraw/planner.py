"""Memory planner: per-rank device peak and host page bytes of one LongStraw GRPO step, from a model
config and a layout (DESIGN sections 2, 3 and 9), and the largest prompt that fits.

Every figure is a formula over the shapes the code allocates, each naming the tensor (and file) it
stands for. Three groups of figures are checked against the built models on CPU
(tests/test_planner.py), for both families:

- host pages: `host_page_bytes_per_rank(_logical)` equal `CapturedPrompt.pages.nbytes()` exactly
  (allocated and logical; Qwen3.6's fixed GDN state and conv tail and its per-token K/V rows at two
  prompt lengths, CP = 1 and, per rank, CP = 2);
- replay activations: `glm52_replay_saved` and `qwen36_replay_saved` reproduce, tensor kind by
  tensor kind, what autograd saves during replay as `memory.SavedTensorMeter` counts it (each saved
  reference by its own bytes), with whole-layer checkpointing on and off: GLM-5.2 at CP = 1 (tests)
  and CP = 2, 4 (tools/evidence.py, level 1); Qwen3.6 at CP = 1 in fp32 and bf16, and CP = 2;
- parameter and LoRA-adapter counts equal the built model's (and `adapters.apply_lora`'s); the
  full-size Qwen3.6 is built on the meta device and counted.

The rest (capture and scoring scratch, MoE dispatch buffers, page window, backward transients, and
for Qwen3.6 the GPU kernels' saved sets: FLA's delta rule and l2norm instead of the PyTorch ones
the CPU runs) is analytic: read off the code, not measured on a GPU; the report labels each item so.

A family is one function `(spec, prompt_len) -> Footprint` registered in `FAMILIES`: `glm52`
against this package's GLM-5.2 model, `qwen36` against its Qwen3.6 model (models/qwen36).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

GiB = 1024 ** 3
MiB = 1024 ** 2

GPU_BYTES = {  # total device memory as nvidia-smi reports it (MiB), per GPU kind
    "H20": 97871 * MiB,
    "H100": 81559 * MiB,
    "H200": 143771 * MiB,
}

DTYPE_BYTES = {"fp64": 8.0, "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0,
               # NF4 with double quantisation (adapters.nf4_nbytes): 4 bits, an 8-bit absmax per
               # 64 values, an fp32 scale per 256 absmax values
               "nf4": 0.5 + 1 / 64 + 4 / (64 * 256)}


@dataclass
class PlanSpec:
    """What the plan is for. Bytes per element are floats (fp8 rows carry a scale)."""

    family: str
    model: object
    """The family's architecture config (GLM52Config, Qwen36Arch)."""
    prompt_len: int
    group_size: int
    response_len: int
    """Longest response R (the replayed branch is R tokens: the prompt's last token + R - 1)."""
    cp: int = 1
    ep: int = 1
    weight_bytes: float = 2.0
    act_bytes: float = 2.0
    """Activations (the model's compute dtype)."""
    latent_bytes: float = 2.0
    """Per element of a latent / K/V page row."""
    index_key_bytes: float = 1 + 4 / 128
    """Per element of an index-key page row (fp8 + one fp32 scale per 128-value row)."""
    trainable: str = "all"
    """all | non_expert | attention | head | lora | none (see `trainable_count`)."""
    lora_rank: int = 64
    """adapters.LoRAConfig.rank; adapters are fp32 (adapters.py's default for 16-bit bases)."""
    lora_experts: bool = False
    """Adapters on the routed experts' linear_fc1/fc2 too (adapters.GLM52_TARGETS matches them
    unless `exclude=("*.experts.*",)`); off: attention, dense MLP and shared-expert linears."""
    trainable_params: int | None = None
    """Override the trainable-parameter count (e.g. a published adapter size)."""
    shard_optimizer: bool = False
    """Megatron's distributed optimizer: fp32 master + Adam moments sharded over DP x CP."""
    kl: bool = False
    """A reference capture for the KL term doubles the pages."""
    page_tokens: int = 65536
    token_block: int = 16384
    query_block: int = 256
    key_block: int = 16384
    gpu_bytes: int = GPU_BYTES["H20"]
    device_reserve: int = 4 * GiB
    """CUDA context, NCCL buffers, allocator slack (assumed)."""
    host_bytes: int = 1024 * GiB
    """Host memory per node."""
    ranks_per_node: int = 8
    host_reserve_per_rank: int = 4 * GiB
    """Python, torch, CUDA host state per process (assumed)."""
    moe_imbalance: float = 1.0
    """Tokens an EP rank receives / the balanced share (1: perfectly balanced routing)."""

    def __post_init__(self) -> None:
        for name in ("prompt_len", "group_size", "response_len", "cp", "ep", "page_tokens",
                     "token_block", "query_block", "key_block", "ranks_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.trainable not in TRAINABLE:
            raise ValueError(f"trainable must be one of {sorted(TRAINABLE)}, got {self.trainable!r}.")


TRAINABLE = {"all", "non_expert", "attention", "head", "lora", "none"}


@dataclass
class ParamGroup:
    name: str
    count: int
    """Parameters in the whole model (all experts)."""
    expert: bool = False
    """Routed-expert weights: split over EP."""
    kind: str = "other"
    """attention | indexer | mlp | experts | embedding | head | other"""
    lora_shapes: list[tuple[int, int]] = field(default_factory=list)
    """(in, out) of each linear a LoRA adapter attaches to (adapters.GLM52_TARGETS)."""


@dataclass
class PageKind:
    name: str
    row_bytes: float
    """Bytes per token row (sequence kinds) or the whole state (fixed kinds)."""
    num_layers: int
    sequence: bool = True


@dataclass
class Item:
    name: str
    bytes: float
    measured: bool = False
    """True where tests/test_planner.py checks the formula against a measurement."""
    group: str = ""
    """Items of one non-empty group are never alive together: the largest one counts."""


def phase_bytes(items: list[Item]) -> float:
    """Bytes at a phase's peak: every ungrouped item plus the largest item of each group."""
    groups: dict[str, float] = {}
    for i in items:
        if i.group:
            groups[i.group] = max(groups.get(i.group, 0.0), i.bytes)
    return sum(i.bytes for i in items if not i.group) + sum(groups.values())


@dataclass
class Footprint:
    """What a family contributes for one prompt length."""

    params: list[ParamGroup]
    pages: list[PageKind]
    phases: dict[str, list[Item]]
    """Phase -> the transient items alive at that phase's peak (on top of the static state)."""
    replay_saved: dict[str, float]
    """SavedTensorMeter-convention bytes of replay (see glm52_replay_saved)."""
    notes: list[str] = field(default_factory=list)
    host: list[Item] = field(default_factory=list)
    """Host bytes per rank beside the pages (held from scoring to replay)."""


# ---- shared helpers -----------------------------------------------------------------------------


def local_prompt_rows(prompt_len: int, cp: int) -> int:
    """Captured rows on the busiest rank: the prefix `prompt[:-1]` in Megatron's load-balanced
    2*CP-chunk order (parallel.CPLayout.prompt_positions)."""
    captured = max(prompt_len - 1, 0)
    if cp == 1:
        return captured
    bounds = [round(captured * i / (2 * cp)) for i in range(2 * cp + 1)]
    return max(bounds[r + 1] - bounds[r] + bounds[2 * cp - r] - bounds[2 * cp - r - 1]
               for r in range(cp))


def page_bytes(pages: list[PageKind], rows: int, page_tokens: int) -> tuple[float, float]:
    """(logical, allocated) bytes of one rank's pages (pages.PageStore.nbytes)."""
    logical = allocated = 0.0
    for kind in pages:
        if kind.sequence:
            logical += kind.num_layers * rows * kind.row_bytes
            allocated += kind.num_layers * math.ceil(rows / page_tokens) * page_tokens * kind.row_bytes
        else:
            logical += kind.num_layers * kind.row_bytes
            allocated += kind.num_layers * kind.row_bytes
    return logical, allocated


def lse_merge_saved(queries: int, rows: int, heads: int, width: int, acc: float) -> float:
    """parallel.merge_partials_by_lse under autograd on one rank: its partial [queries, heads,
    width] over its keys is weighted by exp(lse - max) and [weight * out; weight] is
    reduce-scattered, leaving its own `rows` merged rows. Saved: the weight (and its [..., None]
    view, by the product), the partial in `acc`; numerator / clamp_min(denominator) (both, and
    clamp's input); torch.where's condition (bool)."""
    return (2 * queries * heads * acc + queries * heads * width * acc
            + rows * heads * (width + 2) * acc + rows * heads)


# ---- GLM-5.2 ------------------------------------------------------------------------------------


def glm52_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_glm52_model (Megatron names in comments)."""
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    L, V = cfg.num_hidden_layers, cfg.vocab_size
    proj = [(h, qr), (qr, H * (dn + dr)), (h, kvr + dr), (kvr, H * (dn + v)), (H * v, h)]
    # input_layernorm + q_layernorm + kv_layernorm; linear_q_down/up, linear_kv_down/up, linear_proj
    attention = h + qr + kvr + sum(i * o for i, o in proj)
    # DSAIndexer: linear_wq_b, linear_wk, k_norm (LayerNorm: weight + bias), linear_weights_proj
    indexer = qr * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim \
        + 2 * cfg.index_head_dim + h * cfg.index_n_heads
    dense = cfg.first_k_dense_replace
    moe = L - dense
    mlp = lambda ffn: [(h, 2 * ffn), (ffn, h)]         # linear_fc1 (gated), linear_fc2
    shared = cfg.moe_intermediate_size * cfg.n_shared_experts
    return [
        ParamGroup("embedding", V * h, kind="embedding"),
        ParamGroup("output_layer + final_norm", V * (0 if cfg.tie_word_embeddings else h) + h,
                   kind="head"),
        ParamGroup("attention (MLA)", L * attention, kind="attention", lora_shapes=proj * L),
        ParamGroup("DSA indexer", cfg.num_full_indexer_layers() * indexer, kind="indexer"),
        # pre_mlp_layernorm, linear_fc1 (gated: 2 x ffn), linear_fc2
        ParamGroup("dense MLP", dense * (h + 3 * h * cfg.intermediate_size), kind="mlp",
                   lora_shapes=mlp(cfg.intermediate_size) * dense),
        ParamGroup("MoE router + shared expert + norm",
                   moe * (h + cfg.n_routed_experts * h + 3 * h * shared), kind="mlp",
                   lora_shapes=mlp(shared) * moe),
        ParamGroup("routed experts", moe * cfg.n_routed_experts * 3 * h * cfg.moe_intermediate_size,
                   expert=True, kind="experts",
                   lora_shapes=mlp(cfg.moe_intermediate_size) * moe * cfg.n_routed_experts),
    ]


def glm52_pages(cfg, latent_bytes: float, index_key_bytes: float) -> list[PageKind]:
    """MLA latent rows [c_kv; k_pe] on every layer, index-key rows on full indexer layers
    (attention.py: LATENT, INDEX_KEY)."""
    return [PageKind("latent", (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * latent_bytes,
                     cfg.num_hidden_layers),
            PageKind("index_key", cfg.index_head_dim * index_key_bytes,
                     cfg.num_full_indexer_layers())]


def glm52_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float, router_bytes: float = 4,
                       acc: float | None = None) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed, as SavedTensorMeter counts them
    (one count per saved reference; views of one storage count once each).

    rows: this rank's branch rows (R, or R_pad / CP). Under CP the attention core works on the whole
    gathered branch (R_pad query rows: attention.py `_replay_context_parallel`) and the LSE merge
    saves every rank's partial output. b: activation bytes; acc: float32-or-wider accumulation.
    Returns the parts and the two totals the meter sees: `checkpointed` (whole-layer checkpointing:
    layer inputs + LM head + loss) and `uncheckpointed` (every layer's tensors).
    """
    acc = acc or max(b, 4.0)
    h, H, qr, kvr = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    dn, dr, v, V = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.vocab_size
    d_qk = kvr + dr
    c = rows
    q = rows * cp                                      # attention query rows (gathered under CP)
    k = min(cfg.index_topk, prefix_len + q)            # selection width
    norm = lambda width: (3 * c * width + 2 * c) * b   # torch RMSNorm: input, rstd x2, two products
    attention = (
        norm(h)                                        # input_layernorm
        + c * h * b                                    # linear_kv_down_proj input
        + norm(kvr)                                    # kv_layernorm (c_kv)
        + 2 * c * dr * b                               # RoPE of k_pe (cos, sin saved twice)
        + c * h * b + norm(qr) + c * qr * b            # linear_q_down_proj, q_layernorm, q_up input
        + H * c * dn * b                               # q_nope . W_UK (einsum)
        + 2 * c * dr * b                               # RoPE of q_pe
        + 8 * q * k                                    # selection / local key index (int64)
        + q * k * d_qk * b + q * H * d_qk * b          # gathered latent rows, absorbed queries
        + 2 * q * k                                    # validity masks (bool)
        + 2 * q * H * k * acc + q * H * k * b + 2 * q * H * acc   # logsumexp / exp / probs
        + q * k * kvr * b                              # value rows c_kv (second einsum)
        + H * c * kvr * b                              # out_latent . W_UV (einsum)
        + c * H * v * b                                # linear_proj input
    )
    if cp > 1:  # parallel.merge_partials_by_lse: this rank's [q, H, kvr] partial, its c rows kept
        attention += lse_merge_saved(q, c, H, kvr, acc)
    mlp = lambda ffn: c * h * b + 4 * c * ffn * b     # linear_fc1 input, GLU (3), linear_fc2 input
    dense = norm(h) + mlp(cfg.intermediate_size)
    routed = c * cfg.num_experts_per_tok               # (token, expert) pairs
    E = cfg.n_routed_experts
    moe = (norm(h) + mlp(cfg.moe_intermediate_size * cfg.n_shared_experts)
           + c * h * b                                 # router input
           + 2 * c * E * router_bytes + c * router_bytes + routed * router_bytes  # sigmoid / top-k
           + 3 * routed * 8                            # top-k indices (int64)
           + 2 * routed * 8                            # permutation indices
           + routed * (h * b + 5 * cfg.moe_intermediate_size * b + router_bytes)  # experts + probs
           + routed * h * 8)                           # unpermute scatter index (expanded view)
    # Saved references that are views of another saved tensor (counted by the meter, not by the
    # allocator): the value rows (a slice of the latent rows), the expanded scatter index, and the
    # log-probs saved a second time by gather.
    attention_views = q * k * kvr * b
    moe_views = routed * h * 8 - routed * 8
    layers = [attention + (moe if cfg.is_moe_layer(i) else dense)
              for i in range(cfg.num_hidden_layers)]
    layers_device = [attention - attention_views + (moe - moe_views if cfg.is_moe_layer(i) else dense)
                     for i in range(cfg.num_hidden_layers)]
    head = norm(h) + c * h * b + 2 * c * V * acc + 8 * c   # final_norm, output_layer, log-softmax, gather
    loss = 4 * c * acc + 2 * acc                       # grpo.member_loss: ratio, clip, min, scalars
    embed = 8 * c                                      # token ids
    inputs = cfg.num_hidden_layers * c * h * b         # checkpoint inputs, one per decoder layer
    return {"embedding": embed, "checkpoint_inputs": inputs, "layer_working_set": max(layers),
            "layer_working_set_device": max(layers_device),
            "attention_working_set": attention, "head": head, "head_device": head - c * V * acc,
            "loss": loss,
            "largest_saved_tensor": max(q * k * d_qk * b, q * H * kvr * acc if cp > 1 else 0,
                                        c * V * acc),
            "checkpointed": embed + inputs + head + loss,
            "uncheckpointed": embed + sum(layers) + head + loss}


def glm52(spec: PlanSpec, prompt_len: int) -> Footprint:
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    h, H, kvr, dr = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    d_qk, di, hi, topk = kvr + dr, cfg.index_head_dim, cfg.index_n_heads, cfg.index_topk
    cp, R = spec.cp, spec.response_len
    n = local_prompt_rows(prompt_len, cp)               # captured rows on this rank
    total = max(prompt_len - 1, 0)
    rows = -(-R // cp)                                  # this rank's branch rows
    r_pad = rows * cp
    k = min(topk, total + r_pad)
    pages = glm52_pages(cfg, spec.latent_bytes, spec.index_key_bytes)
    index_row = di * spec.index_key_bytes
    saved = glm52_replay_saved(cfg, rows, cp, total, b, acc=acc)
    indexer_block = lambda queries: (queries * hi * spec.key_block * acc + queries * spec.key_block * acc
                                     + 2 * queries * (topk + min(topk, spec.key_block)) * (acc + 8))

    # Capture (capture.py; attention.py `_attend_local_keys`; common.run_group), one layer at a time.
    # Attention layers and MoE layers peak separately ("one of" groups: the largest counts).
    qb = min(spec.query_block, max(n, 1))
    chunk = -(-n // max(1, -(-n // spec.token_block))) if n else 0
    routed = chunk * cfg.num_experts_per_tok * spec.moe_imbalance
    gathered = 0.0
    if cp > 1:  # parallel.gather_sequence: the whole prompt's keys on every rank, plus its buffers
        gathered = max(2 * total * d_qk * b, total * d_qk * b + 2 * total * di * b) + 8 * total
    capture_attention = [
        Item("capture residual stream [P/CP, h] x2 (layer input, input-norm output)", 2 * n * h * b),
        Item("capture selection [P/CP, topk] int64 x2 (kept for IndexShare; grows by cat)",
             2 * n * min(topk, total) * 8),
        Item("gathered prompt keys [P, latent + index] (CP all-gather)", gathered),
        Item("capture own rows [P/CP, latent + index]", n * (d_qk + di) * b),
        Item("capture attention output [P/CP, heads*v] x2 (block list + cat)",
             2 * n * H * cfg.v_head_dim * b),
        Item("indexer scores block [query_block, index_heads, key_block] fp32", indexer_block(qb),
             group="block"),
        Item("sparse attention block [query_block, topk, latent] + logits",
             qb * topk * d_qk * b + qb * H * topk * (b + 3 * acc), group="block"),
    ]
    capture_moe = [
        Item("capture residual stream [P/CP, h] x3 (layer input, chunk outputs, cat)", 3 * n * h * b),
        Item("capture selection [P/CP, topk] int64 (latest full indexer layer)",
             n * min(topk, total) * 8),
        Item("MoE dispatch buffers (one token chunk: permuted, received, expert in/out)",
             routed * (4 * h * b + 3 * cfg.moe_intermediate_size * b)),
    ]
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs (two
    # layers' local pages), attention cats [prefix; branch] latents, the CP path builds a global
    # position lookup.
    common = [Item("streamed page window (2 layers' local pages + latent cat copy)",
                   2 * n * (d_qk * spec.latent_bytes + index_row) + (n + r_pad) * d_qk * b),
              Item("global position lookup [P + R] int64 (CP path)",
                   8 * (total + r_pad) if cp > 1 else 0)]
    # Every member's DSA selections wait for replay in host memory, as int32 (replay.score_member).
    host = [Item("scored DSA selections: G x full indexer layers x [R, topk] int32",
                 spec.group_size * cfg.num_full_indexer_layers() * r_pad * k * 4)]
    scoring = common + [
        Item("indexer scores [query_block, index_heads, key_block] fp32",
             indexer_block(min(spec.query_block, r_pad)), group="step"),
        # Under CP the gathered queries are selected per query block too (attention.py): the
        # exchanged candidates are [query_block, CP x 2 topk].
        Item("global top-k merge [query_block, CP x 2 topk] (scores, positions, sort)",
             min(spec.query_block, r_pad) * cp * 2 * k * (3 * acc + 5 * 8) if cp > 1 else 0,
             group="step"),
        Item("LSE merge: [weight * out; weight] [R, heads, kv_lora_rank + 1] fp32 + reduce-scatter",
             2 * r_pad * H * (kvr + 1) * acc if cp > 1 else 0, group="step"),
    ]
    replay = common + [
        Item("replay checkpoint inputs [R/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"], measured=True),
        Item("replay recompute working set (one decoder layer)", saved["layer_working_set_device"],
             measured=True, group="graph"),
        Item("replay LM head + loss (before the layers' backward)",
             saved["head_device"] + saved["loss"], measured=True, group="graph"),
        Item("replay backward transient (gradient of the largest saved tensor)",
             saved["largest_saved_tensor"]),
        Item("replay page-gradient buffer [P/CP + R, latent] (index backward)", (n + r_pad) * d_qk * b),
    ]
    notes = []
    if cp > 1:
        notes.append("CP replay gathers all R_pad branch queries on every rank and merges the "
                     "partial outputs [R_pad, heads, kv_lora_rank] by log-sum-exp with a "
                     "reduce-scatter: the attention working set grows with R, not R/CP.")
    return Footprint(params=glm52_params(cfg), pages=pages,
                     phases={"capture (attention layer)": capture_attention,
                             "capture (MoE layer)": capture_moe,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes, host=host)


# ---- Qwen3.6 ------------------------------------------------------------------------------------

GDN_CHUNK = 64
"""Token chunk of both delta-rule kernels (Megatron's `torch_chunk_gated_delta_rule` default and
FLA's `chunk_gated_delta_rule`)."""


def _qwen36_sizes(cfg) -> tuple[int, int]:
    """(full-attention layers, GDN layers)."""
    num_attention = cfg.num_full_attention_layers()
    return num_attention, cfg.num_hidden_layers - num_attention


def _check_qwen36_cp(cfg, cp: int) -> None:
    if cfg.linear_num_key_heads % cp:
        raise ValueError(f"CP {cp} must divide the GDN query/key heads ({cfg.linear_num_key_heads}): "
                         "GDN layers shard by heads under context parallelism.")


def qwen36_params(cfg) -> list[ParamGroup]:
    """Every parameter of build_qwen36_model (Megatron names in comments)."""
    h, V, ffn = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    H, G, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    num_attention, num_gdn = _qwen36_sizes(cfg)
    L = cfg.num_hidden_layers
    gdn_proj = [(h, 2 * hk * dk + 2 * hv * dv + 2 * hv),   # in_proj rows [q; k; v; z; beta; alpha]
                (hv * dv, h)]                              # out_proj
    # input_layernorm, conv1d (depthwise [conv_dim, 1, kernel], no bias), A_log, dt_bias, out_norm
    gdn = (h + cfg.conv_dim() * cfg.linear_conv_kernel_dim + 2 * hv + dv
           + sum(i * o for i, o in gdn_proj))
    attention_proj = [(h, 2 * H * d + 2 * G * d),           # linear_qkv rows [q; gate; k; v]
                      (H * d, h)]                           # linear_proj
    # input_layernorm, q_layernorm, k_layernorm (per head_dim)
    attention = h + 2 * d + sum(i * o for i, o in attention_proj)
    mlp_proj = [(h, 2 * ffn), (ffn, h)]                     # linear_fc1 (gated), linear_fc2
    return [
        ParamGroup("embedding", V * h, kind="embedding"),
        ParamGroup("output_layer + final_norm", V * (0 if cfg.tie_word_embeddings else h) + h,
                   kind="head"),
        ParamGroup("Gated DeltaNet", num_gdn * gdn, kind="attention", lora_shapes=gdn_proj * num_gdn),
        ParamGroup("gated attention", num_attention * attention, kind="attention",
                   lora_shapes=attention_proj * num_attention),
        # pre_mlp_layernorm + the two linears, every layer
        ParamGroup("dense MLP", L * (h + 3 * h * ffn), kind="mlp", lora_shapes=mlp_proj * L),
    ]


def qwen36_pages(cfg, kv_bytes: float, conv_bytes: float, state_bytes: float, cp: int = 1,
                 captured: bool = True) -> list[PageKind]:
    """One rank's captured kinds: K and V rows [groups, head_dim] per full-attention layer
    (attention.py KEY, VALUE; under CP this rank's prompt shard); per GDN layer the recurrent state
    [H_v / CP, d_k, d_v] and the conv tail [kernel - 1, conv_dim / CP] (gdn.py GDN_STATE, CONV_TAIL;
    under CP sharded by heads). `captured` False (a one-token prompt): nothing is stored."""
    _check_qwen36_cp(cfg, cp)
    num_attention, num_gdn = _qwen36_sizes(cfg)
    num_gdn = num_gdn if captured else 0
    row = cfg.num_key_value_heads * cfg.head_dim * kv_bytes
    state = cfg.linear_num_value_heads // cp * cfg.linear_key_head_dim * cfg.linear_value_head_dim
    tail = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim() // cp
    return [PageKind("key", row, num_attention), PageKind("value", row, num_attention),
            PageKind("gdn_state", state * state_bytes, num_gdn, sequence=False),
            PageKind("conv_tail", tail * conv_bytes, num_gdn, sequence=False)]


def zero_centred_norm_saved(rows: int, width: int, acc: float) -> float:
    """spec.ZeroCenteredRMSNorm over [rows, width], all in `acc`: pow's input, rsqrt's output, the
    normalising product's two inputs, the gain product's two inputs ((1 + weight) is a new tensor)."""
    return (3 * rows * width + 2 * rows + width) * acc


def torch_chunk_delta_rule_saved(rows: int, heads: int, dk: int, dv: int,
                                 f: float = 4) -> tuple[float, float]:
    """Megatron-Core's `torch_chunk_gated_delta_rule` (the CPU kernel, gated_delta_net/common.py)
    under autograd, from an initial state that needs no gradient (a captured page, or zeros): every
    tensor in float32 (`f`), rows padded to whole chunks of C = GDN_CHUNK. Line numbers are
    Megatron-Core 0.19.2's.

    The last chunk's state update (lines 888-889) feeds only the final state, which replay drops, so
    its graph, with the two `exp` outputs it saved, is freed when the call returns.

    Returns (bytes kept until backward, bytes of that last update: saved while the call runs, freed
    when it returns)."""
    C, H = GDN_CHUNK, heads
    chunks = -(-rows // C)
    if chunks == 0:
        return 0.0, 0.0
    T = chunks * C
    square = H * chunks * C * C                                # one [H, chunks, C, C] tensor
    before_loop = (
        H * T * (dv + 1) + H * T * (dk + 1)                    # v * beta, k * beta (846, 847)
        + square                                               # decay_mask = exp(...) (860)
        + 2 * H * T * dk + 2 * square                          # (k_beta @ k^T) * decay_mask (861)
        + H * chunks * (C - 1) * C * (C + 1) // 3              # row [i], sub [i, i] per i < C (865)
        + square + H * T * dv                                  # attn @ v_beta (867)
        + 2 * H * T + H * T * dk + square + H * T * dk         # attn @ (k_beta * exp(g)) (868)
    )
    per_chunk = (2 * H * C * dk + 2 * H * C * C                # q_i @ k_i^T * decay_mask_i (882)
                 + H * dk * dv                                 # k_cumdecay_i @ S (883)
                 + 2 * H * C + H * C * dk + H * dk * dv        # (q_i * exp(g_i)) @ S (885)
                 + H * C * C + H * C * dv)                     # attn_i @ v_new (886)
    state_grad = 2 * H * C * dk        # S has grad from chunk 2 on: 883/885 save their left side
    update = (H + H * dk * dv                                  # S * exp(g_last) (888)
              + 2 * H * C + H * C * dk + H * dk * C + H * C * dv)  # (k * exp(..))^T @ v_new (889)
    floats = (before_loop + chunks * per_chunk + (chunks - 1) * (state_grad + update)
              + max(chunks - 2, 0) * H)                        # 888 saves exp(g_last) once S has grad
    masks = C * C + chunks * C * C                             # bool masks of 861 and 882
    last_update = update + (H if chunks > 1 else 0)
    return floats * f + masks, last_update * f


def fla_chunk_delta_rule_saved(rows: int, heads: int, dk: int, dv: int, b: float) -> float:
    """FLA's `ChunkGatedDeltaRuleFunction` (the GPU kernel): saves q, k, v (H_v heads), g's chunk
    cumsum (fp32), beta and A [rows, H, C] in k's dtype (fla/ops/gated_delta_rule/chunk.py); the
    initial state it also saves is the fetched page (counted in the page window). Analytic."""
    return rows * heads * ((2 * dk + dv + 1 + GDN_CHUNK) * b + 4)


def qwen36_replay_saved(cfg, rows: int, cp: int, prefix_len: int, b: float, query_block: int,
                        acc: float | None = None) -> dict[str, float]:
    """Bytes autograd saves while one member's branch is replayed, as SavedTensorMeter counts them
    (one count per saved reference), kind by kind, with the CPU kernels (torch chunk delta rule,
    PyTorch l2norm); `*_device` figures swap in FLA's kernels and count tensors saved several times
    once.

    rows: this rank's branch rows (R, or R_pad / CP). prefix_len: this rank's captured prompt rows.
    Under CP (DESIGN section 3 as models/qwen36 implements it; checked at CP = 2) GDN layers run
    all R_pad rows for H_v / CP heads (in_proj output exchanged to heads and back), and full
    attention gathers all R_pad queries, keys and values, attends over [prefix shard; branch] and
    merges the partial outputs by log-sum-exp into this rank's rows. Returns the parts and the
    totals `checkpointed` (whole-layer checkpointing: layer inputs + LM head + loss) and
    `uncheckpointed` (every layer's tensors; the larger of the end of the forward and the moment
    inside the last GDN layer, see below).
    """
    _check_qwen36_cp(cfg, cp)
    acc = acc or max(b, 4.0)
    f = max(4.0, b)                                    # the torch delta rule computes in float32
    h, V, ffn = cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size
    H, G, d, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim()
    hk, hv = cfg.linear_num_key_heads // cp, cfg.linear_num_value_heads // cp   # this rank's heads
    dk, dv, K = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    conv = cfg.conv_dim() // cp
    in_proj = 2 * cfg.linear_num_key_heads * dk + 2 * cfg.linear_num_value_heads * dv \
        + 2 * cfg.linear_num_value_heads
    c = rows
    s = rows * cp                                      # GDN rows, attention queries (all, under CP)
    norm = lambda n, w: zero_centred_norm_saved(n, w, acc)
    mlp = norm(c, h) + c * h * b + 4 * c * ffn * b    # pre_mlp_layernorm, fc1 in, GLU (3), fc2 in

    gdn_after_core = (norm(s * hv, dv)                           # out_norm (returns x's dtype)
                      + s * hv * dv * (b + 2 * acc)              # * silu(gate.float())
                      + c * hv * cp * dv * b)                    # out_proj input (this rank's rows)
    gdn_outer = (
        norm(c, h) + c * h * b                         # input_layernorm, in_proj input
        + conv * (s + K - 1) * b + conv * s * b        # conv1d input [tail; branch], silu input
        + 2 * hv * b + 2 * s * hv * acc + s * hv * b   # g = -exp(A_log) * softplus(.), sigmoid(beta)
    )
    if cp > 1:
        # parallel.HeadParallel: in_proj output to heads (head permutation index, row index), this
        # rank's conv1d weight (a copy); back to rows (index_copy's index and source)
        gdn_outer += 8 * in_proj + 8 * s + conv * K * b
        gdn_after_core += 8 * s + s * hv * dv * b
    gdn_outer += gdn_after_core
    l2norm = 3 * s * 2 * hk * dk * acc + 2 * s * 2 * hk * acc      # platform._torch_l2norm on [q; k]
    l2norm_device = s * 2 * hk * (dk * b + 4)                       # FLA l2norm: output, rstd
    core, core_transient = torch_chunk_delta_rule_saved(s, hv, dk, dv, f)
    gdn = gdn_outer + l2norm + core
    gdn_device = gdn_outer + l2norm_device + fla_chunk_delta_rule_saved(s, hv, dk, dv, b)

    keys = prefix_len + s                              # [prefix (shard); branch]
    num_query_blocks = -(-s // query_block)
    queries = s * (2 * H * d * b + H * acc + 8)        # q and out blocks, lse, q positions
    key_rows = keys * (2 * G * d * b + 8)              # K, V ([pages; branch] cat copy), positions
    attention_outer = (
        norm(c, h) + c * h * b                         # input_layernorm, linear_qkv input
        + norm(c * H, d) + norm(c * G, d)              # q_layernorm, k_layernorm
        + 4 * c * rot * b                              # RoPE cos / sin, q and k
        + c * H * d * (b + 2 * acc)                    # o * sigmoid(gate)
        + c * H * d * b                                # linear_proj input
    )
    if cp > 1:  # log-sum-exp merge of this rank's [s, H, d] partial, keeping its c rows
        attention_outer += lse_merge_saved(s, c, H, d, acc)
    attention = attention_outer + queries + num_query_blocks * key_rows   # keys saved per query block
    attention_device = attention_outer + queries + key_rows

    # final_norm, output_layer input, log-softmax (saved twice: its output and gather's input), index
    head = norm(c, h) + c * h * b + 2 * c * V * acc + 8 * c
    loss = 4 * c * acc + 2 * acc                       # grpo.member_loss: ratio, clip, min, scalars
    embed = 8 * c                                      # token ids
    inputs = cfg.num_hidden_layers * c * h * b         # checkpoint inputs, one per decoder layer
    layers = [attention + mlp if cfg.is_full_attention(i) else gdn + mlp
              for i in range(cfg.num_hidden_layers)]
    end_of_forward = embed + sum(layers) + head + loss
    # Without checkpointing the meter can peak inside the last GDN layer instead (short branches
    # over a short prefix): as its delta rule returns, the last state update is still saved and
    # the gated norm after it not yet.
    gdn_idx = [i for i in range(cfg.num_hidden_layers) if not cfg.is_full_attention(i)]
    inside_last_gdn = (embed + sum(layers[:gdn_idx[-1]]) + gdn - gdn_after_core + core_transient
                       if gdn_idx else 0.0)
    return {"embedding": embed, "checkpoint_inputs": inputs,
            "gdn_layer": gdn + mlp, "attention_layer": attention + mlp,
            "layer_working_set": max(gdn, attention) + mlp,
            "layer_working_set_device": max(gdn_device, attention_device) + mlp,
            "gdn_working_set_device": gdn_device + mlp,
            "attention_working_set_device": attention_device + mlp,
            "head": head, "head_device": head - c * V * acc, "loss": loss,
            "largest_saved_tensor": max(keys * G * d * b, c * V * acc, s * hv * dv * acc,
                                        s * H * d * acc if cp > 1 else 0),
            "checkpointed": embed + inputs + head + loss,
            "end_of_forward": end_of_forward, "inside_last_gdn": inside_last_gdn,
            "uncheckpointed": max(end_of_forward, inside_last_gdn)}


def qwen36(spec: PlanSpec, prompt_len: int) -> Footprint:
    """Qwen3.6 against models/qwen36: parameters, pages and the replay saved set checked on CPU
    (tests/test_planner.py); capture, scoring and the device kernels' scratch analytic."""
    cfg = spec.model
    b, acc = spec.act_bytes, max(spec.act_bytes, 4.0)
    cp, R = spec.cp, spec.response_len
    h, ffn, H, G, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads,
                       cfg.num_key_value_heads, cfg.head_dim)
    hv, dk, dv = cfg.linear_num_value_heads // cp, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    in_proj = 2 * cfg.linear_num_key_heads * dk + 2 * cfg.linear_num_value_heads * dv \
        + 2 * cfg.linear_num_value_heads
    n = local_prompt_rows(prompt_len, cp)               # captured rows on this rank
    total = max(prompt_len - 1, 0)
    rows = -(-R // cp)                                  # this rank's branch rows
    r_pad = rows * cp
    state_bytes = max(4.0, b)                           # both delta-rule kernels keep S in fp32
    pages = qwen36_pages(cfg, spec.latent_bytes, spec.latent_bytes, state_bytes, cp, total > 0)
    saved = qwen36_replay_saved(cfg, rows, cp, n, b, spec.query_block, acc=acc)
    kv_row = 2 * G * d * spec.latent_bytes              # one layer's K and V page bytes per token
    fixed = sum(p.row_bytes for p in pages if not p.sequence and p.num_layers)  # one GDN layer

    # Capture (capture.py, attention.py, gdn.py; models/common.run_group), one layer at a time.
    tb = min(spec.token_block, max(n, 1))
    qb = min(spec.query_block, max(n, 1))
    kb = spec.key_block
    scores = lambda queries: 3 * queries * H * kb * acc  # scores, probabilities, their product
    fla_block = lambda tokens: (             # FLA forward scratch for `tokens` rows
        tokens * hv * ((3 * dk + 4 * dv + 64) * b + 64 * 4 + 8)   # q k v w u v_new o, A, g, beta
        + -(-tokens // GDN_CHUNK) * hv * dk * dv * b)             # h: the state at every chunk start
    gdn_block = lambda tokens: (tokens * in_proj // cp * b       # in_proj output (this rank's heads)
                                + 3 * tokens * cfg.conv_dim() // cp * b  # conv input, output, silu
                                + 3 * tokens * hv * dv * acc     # gated norm
                                + fla_block(tokens))
    residual = Item("capture residual stream [P/CP, h] x3 (layer input, block outputs, cat)",
                    3 * n * h * b)
    if cp == 1:
        capture_attention = [
            residual,
            Item("capture K/V buffers [P, groups, d] x2 (attention.py _causal_in_order)",
                 2 * n * G * d * b),
            Item("capture projections of one token block (q, gate [tb, heads, d], k, v)",
                 tb * (2 * H + 2 * G) * d * b),
            Item("attention block scratch [query_block, heads, key_block] fp32", scores(qb)),
        ]
        capture_gdn = [residual, Item("GDN token block scratch (in_proj, conv, gated norm, FLA "
                                      "chunk kernel incl. per-chunk states)", gdn_block(tb))]
    else:
        capture_attention = [
            residual,
            Item("capture q, gate [P/CP, heads, d] and k, v [P/CP, groups, d] (whole shard)",
                 n * (2 * H + 2 * G) * d * b),
            Item("broadcast K/V shard [P/CP, groups, d] x2 + positions", n * (2 * G * d * b + 8)),
            Item("running output + log-sum-exp merge [P/CP, heads, d] x3", 3 * n * H * d * b
                 + 4 * n * H * acc),
            Item("attention block scratch [query_block, heads, key_block] fp32", scores(qb)),
        ]
        capture_gdn = [
            residual,
            Item("GDN in_proj output, head-parallel [P, in_proj_dim / CP] (all-to-all)",
                 total * in_proj // cp * b),
            Item("GDN mixed output [P, H_v / CP * d_v] (block list + cat + exchange back)",
                 3 * total * hv * dv * b),
            Item("GDN token block scratch (conv, gated norm, FLA chunk kernel incl. per-chunk "
                 "states)", gdn_block(tb) - tb * in_proj // cp * b),
        ]
    capture_mlp = [residual, Item("MLP token chunk [token_block, 3 x ffn] + zero-centred norm fp32",
                                  tb * (3 * ffn * b + 2 * h * acc))]
    # Scoring and replay stream the pages: replay.py prefetches layer l+1 while l runs, so one
    # attention layer's K/V and one GDN layer's state are on the device at once.
    window = Item("streamed page window (one attention layer's K/V + one GDN layer's state)",
                  n * kv_row + fixed)
    scoring = [window,
               Item("K/V cat [P/CP + R, groups, d] x2 (scoring copy)", (n + r_pad) * 2 * G * d * b),
               Item("attention block scratch [query_block, heads, key_block] fp32",
                    scores(min(spec.query_block, r_pad))),
               Item("LSE merge: [weight * out; weight] [R, heads, d + 1] fp32 + reduce-scatter",
                    2 * r_pad * H * (d + 1) * acc if cp > 1 else 0)]
    replay = [
        window,
        Item("replay checkpoint inputs [R/CP, h] x layers + token ids",
             saved["checkpoint_inputs"] + saved["embedding"], measured=True),
        Item("replay recompute: attention layer + MLP (K/V cat counted once)",
             saved["attention_working_set_device"], measured=True, group="graph"),
        Item("replay recompute: GDN layer + MLP (FLA kernel's saved set, analytic)",
             saved["gdn_working_set_device"], group="graph"),
        Item("replay LM head + loss (before the layers' backward)",
             saved["head_device"] + saved["loss"], measured=True, group="graph"),
        Item("replay attention backward: grad K/V [P/CP + R, groups, d] fp32 x2 + block scratch",
             2 * (n + r_pad) * G * d * acc + scores(min(spec.query_block, r_pad))),
        Item("replay backward transient (gradient of the largest saved tensor)",
             saved["largest_saved_tensor"]),
    ]
    notes = ["qwen36: parameters, page bytes and replay saved-tensor bytes (CPU kernels) are checked "
             "against the model (tests/test_planner.py); the GDN layer's device working set (FLA "
             "kernels), capture and scoring scratch are analytic."]
    if cp > 1:
        notes.append(f"CP = {cp}: per-rank pages (K/V of the load-balanced prompt shard; GDN state "
                     "and conv tail sharded by heads, 1 / CP per rank) and replay saved bytes follow "
                     "models/qwen36's CP path, checked at CP = 2 on the tiny model; other sizes are "
                     "the same formulas, not measured. Replay runs GDN over all R_pad rows for "
                     "H_v / CP heads and gathers all R_pad queries for attention: those working sets "
                     "grow with R, not R / CP.")
    return Footprint(params=qwen36_params(cfg), pages=pages,
                     phases={"capture (attention layer)": capture_attention,
                             "capture (GDN layer)": capture_gdn, "capture (MLP)": capture_mlp,
                             "scoring": scoring, "replay": replay},
                     replay_saved=saved, notes=notes)


FAMILIES: dict[str, Callable[[PlanSpec, int], Footprint]] = {"glm52": glm52, "qwen36": qwen36}


# ---- the plan -----------------------------------------------------------------------------------


def trainable_count(spec: PlanSpec, params: list[ParamGroup]) -> tuple[float, float]:
    """(dense, expert) trainable parameters held by one rank (experts: this rank's share)."""
    if spec.trainable_params is not None:
        return float(spec.trainable_params), 0.0
    mode = spec.trainable
    if mode == "lora":
        count = lambda g: sum(spec.lora_rank * (i + o) for i, o in g.lora_shapes)
        return (float(sum(count(g) for g in params if not g.expert)),
                sum(count(g) for g in params if g.expert) / spec.ep if spec.lora_experts else 0.0)
    pick = {"all": lambda g: True, "none": lambda g: False,
            "non_expert": lambda g: not g.expert,
            "attention": lambda g: g.kind == "attention",
            "head": lambda g: g.kind == "head"}[mode]
    dense = sum(g.count for g in params if pick(g) and not g.expert)
    expert = sum(g.count for g in params if pick(g) and g.expert) / spec.ep
    return float(dense), float(expert)


@dataclass
class Plan:
    spec: PlanSpec
    static: list[Item]
    phases: dict[str, list[Item]]
    phase_totals: dict[str, float]
    device_peak_bytes_per_rank: float
    peak_phase: str
    page_bytes_per_token: float
    host_page_bytes_per_rank: float
    host_page_bytes_per_rank_logical: float
    host_bytes_per_node: float
    replay_saved: dict[str, float]
    notes: list[str]
    host_items: list[Item] = field(default_factory=list)
    """Host bytes per rank beside the pages (Footprint.host)."""
    max_prompt_len_device: int | None = None
    max_prompt_len_host: int | None = None
    max_response_len_device: int | None = None
    """Longest response whose step fits the device at this prompt length."""

    @property
    def max_prompt_len(self) -> int | None:
        vals = [self.max_prompt_len_device, self.max_prompt_len_host]
        return None if None in vals else min(vals)

    @property
    def device_fits(self) -> bool:
        return self.device_peak_bytes_per_rank <= self.spec.gpu_bytes - self.spec.device_reserve

    @property
    def host_fits(self) -> bool:
        return self.host_bytes_per_node <= self.spec.host_bytes

    def to_dict(self) -> dict:
        s = self.spec
        return {
            "family": s.family, "prompt_len": s.prompt_len, "group_size": s.group_size,
            "response_len": s.response_len, "cp": s.cp, "ep": s.ep, "trainable": s.trainable,
            "gpu_bytes": s.gpu_bytes, "device_reserve": s.device_reserve,
            "host_bytes_per_node": s.host_bytes, "ranks_per_node": s.ranks_per_node,
            "page_bytes_per_token": self.page_bytes_per_token,
            "host_page_bytes_per_rank": self.host_page_bytes_per_rank,
            "host_page_bytes_per_rank_logical": self.host_page_bytes_per_rank_logical,
            "host_bytes_per_node_needed": self.host_bytes_per_node,
            "host_items_per_rank": {i.name: i.bytes for i in self.host_items},
            "device_peak_bytes_per_rank": self.device_peak_bytes_per_rank,
            "peak_phase": self.peak_phase, "device_fits": self.device_fits,
            "host_fits": self.host_fits,
            "static": {i.name: i.bytes for i in self.static},
            "phases": {p: {i.name: i.bytes for i in items} for p, items in self.phases.items()},
            "phase_totals": self.phase_totals,
            "replay_saved": self.replay_saved,
            "max_prompt_len": self.max_prompt_len,
            "max_prompt_len_device": self.max_prompt_len_device,
            "max_prompt_len_host": self.max_prompt_len_host,
            "max_response_len_device": self.max_response_len_device,
            "notes": self.notes,
        }


def base_weight_bytes(spec: PlanSpec, params: list[ParamGroup]) -> float:
    """One rank's base weights (routed experts / EP). NF4 (QLoRA, `adapters.apply_lora(...,
    quantize_base=True)`) quantises only the linears an adapter wraps (the groups' lora_shapes,
    routed experts with `lora_experts`); embedding, output layer, norms and the rest stay in the
    activation dtype. Other dtypes apply to every parameter."""
    share = lambda g: 1 / spec.ep if g.expert else 1
    if spec.weight_bytes >= 1:
        return sum(g.count * share(g) for g in params) * spec.weight_bytes
    total = 0.0
    for g in params:
        quantised = sum(i * o for i, o in g.lora_shapes) if spec.lora_experts or not g.expert else 0
        total += share(g) * (quantised * spec.weight_bytes + (g.count - quantised) * spec.act_bytes)
    return total


def _evaluate(spec: PlanSpec, prompt_len: int) -> Plan:
    fp = FAMILIES[spec.family](spec, prompt_len)
    weights = base_weight_bytes(spec, fp.params)
    dense, expert = trainable_count(spec, fp.params)
    # Adapters (and a given trainable count: QLoRA) are fp32 parameters of their own: no master
    # copy. Full fine-tuning of 16-bit weights keeps an fp32 master copy beside Adam's moments.
    own = spec.trainable == "lora" or spec.trainable_params is not None
    optimizer_bytes = 8 if own or spec.weight_bytes >= 4 else 12
    shard = spec.cp if spec.shard_optimizer else 1     # distributed optimizer over DP x CP (DP = 1)
    static = [
        Item(f"base weights ({spec.weight_bytes:.4g} B/param"
             + (f", adapted linears only, the rest {spec.act_bytes:.4g} B" if spec.weight_bytes < 1
                else "") + f"; routed experts / EP={spec.ep})", weights),
        Item("adapter weights (fp32)", 4 * (dense + expert) if own else 0.0),
        Item("gradients (fp32 main_grad, trainable)", 4 * (dense + expert)),
        Item(("optimizer (Adam m, v fp32)" if optimizer_bytes == 8 else "optimizer (fp32 master + "
              "Adam m, v)") + (f"; dense sharded / {shard}" if shard > 1 else ""),
             optimizer_bytes * (dense / shard + expert)),
    ]
    static_total = sum(i.bytes for i in static)
    totals = {p: static_total + phase_bytes(items) for p, items in fp.phases.items()}
    peak_phase = max(totals, key=totals.get)
    rows = local_prompt_rows(prompt_len, spec.cp)
    logical, allocated = page_bytes(fp.pages, rows, spec.page_tokens)
    copies = 2 if spec.kl else 1
    per_token = sum(p.row_bytes * p.num_layers for p in fp.pages if p.sequence)
    return Plan(spec=spec, static=static, phases=fp.phases, phase_totals=totals,
                device_peak_bytes_per_rank=totals[peak_phase], peak_phase=peak_phase,
                page_bytes_per_token=per_token,
                host_page_bytes_per_rank=copies * allocated,
                host_page_bytes_per_rank_logical=copies * logical,
                host_bytes_per_node=spec.ranks_per_node
                * (copies * allocated + sum(i.bytes for i in fp.host) + spec.host_reserve_per_rank),
                replay_saved=fp.replay_saved, notes=fp.notes, host_items=fp.host)


def _largest(fits: Callable[[int], bool], hi: int = 1 << 34, lo: int = 1) -> int | None:
    """Largest x in [lo, hi] with fits(x) (fits is monotone decreasing in x); None if none."""
    if not fits(lo):
        return None
    if fits(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def plan(spec: PlanSpec, search_max: bool = True) -> Plan:
    """The plan at spec.prompt_len, with the largest prompt that fits the device and the host."""
    result = _evaluate(spec, spec.prompt_len)
    if search_max:
        result.max_prompt_len_device = _largest(lambda p: _evaluate(spec, p).device_fits, lo=2)
        result.max_prompt_len_host = _largest(lambda p: _evaluate(spec, p).host_fits, lo=2)
        result.max_response_len_device = _largest(
            lambda r: _evaluate(dataclasses.replace(spec, response_len=r), spec.prompt_len).device_fits,
            hi=1 << 22)
    return result


def format_plan(p: Plan) -> str:
    """A readable breakdown (GiB)."""
    g = lambda x: f"{x / GiB:10.2f} GiB"
    s = p.spec
    lines = [f"LongStraw memory plan: {s.family}, P={s.prompt_len:,}, G={s.group_size}, "
             f"R={s.response_len}, CP={s.cp}, EP={s.ep}, trainable="
             + (f"{s.trainable_params:,} params (given)" if s.trainable_params is not None
                else s.trainable + (f" (rank {s.lora_rank})" if s.trainable == "lora" else "")),
             f"  page bytes per token (all layers)       {p.page_bytes_per_token:,.1f} B",
             "  static (every phase)"]
    lines += [f"    {g(i.bytes)}  {i.name}" for i in p.static]
    for phase, items in p.phases.items():
        lines.append(f"  {phase} (on top of static): total {g(p.phase_totals[phase]).strip()}")
        lines += [f"    {g(i.bytes)}  {i.name}{f'  (one of: {i.group})' if i.group else ''}"
                  f"{'  [checked on CPU]' if i.measured else ''}" for i in items if i.bytes]
    usable = s.gpu_bytes - s.device_reserve
    lines += [
        f"  device peak per rank ({p.peak_phase}): {g(p.device_peak_bytes_per_rank).strip()} of "
        f"{g(usable).strip()} usable ({g(s.gpu_bytes).strip()} - {g(s.device_reserve).strip()} reserve)"
        f" -> {'fits' if p.device_fits else 'DOES NOT FIT'}",
        f"  host pages per rank: {g(p.host_page_bytes_per_rank).strip()} allocated "
        f"({g(p.host_page_bytes_per_rank_logical).strip()} logical, page_tokens={s.page_tokens})",
        *[f"  host beside the pages per rank: {g(i.bytes).strip()}  {i.name}" for i in p.host_items],
        f"  host per node ({s.ranks_per_node} ranks, + {g(s.host_reserve_per_rank).strip()} each): "
        f"{g(p.host_bytes_per_node).strip()} of {g(s.host_bytes).strip()} -> "
        f"{'fits' if p.host_fits else 'DOES NOT FIT'}",
        f"  largest prompt: device {_fmt_len(p.max_prompt_len_device)}, host "
        f"{_fmt_len(p.max_prompt_len_host)} -> {_fmt_len(p.max_prompt_len)}",
        f"  longest response that fits the device at P={s.prompt_len:,}: "
        f"{_fmt_len(p.max_response_len_device, 1)}",
    ]
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def _fmt_len(n: int | None, smallest: int = 2) -> str:
    return f"none (does not fit even at {smallest})" if n is None else f"{n:,}"
