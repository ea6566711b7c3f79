"""NF4 storage (megatron_longstraw/kernels/nf4.py) on every bitsandbytes CPU path: the round trip is within
NF4's blockwise bound for weights whose last dimension is and is not a multiple of 64 and for odd
shapes, on whatever bitsandbytes kernel this CPU runs and on the generic path always. Every CPU
kernel bitsandbytes has runs here whatever the CPU: the machine's own, its two native paths
emulated (blocks over the flattened weight without AVX-512, along each row with AVX-512) and a
CPU without its native library (a subprocess that refuses to load it). A library bug is asserted
only where it is measured; the guard names the weight when a broken layout comes back; a QLoRA
forward equals the model whose base weights are the generic dequantise. `make test` runs it with
LONGSTRAW_NF4_DEQUANTIZE unset; `LONGSTRAW_NF4_DEQUANTIZE=generic make test` passes too."""

import pytest
import torch

from helpers import build_tiny_glm
from megatron_longstraw.kernels import nf4
from megatron_longstraw.adapters.lora import LoRAConfig, apply_lora, lora_modules
from megatron_longstraw.models.glm52.family import LORA_TARGETS as GLM52_TARGETS

bnb_functional = pytest.importorskip("bitsandbytes.functional")

# The 16 NF4 values of the QLoRA paper (Dettmers et al. 2023, appendix E): written here, not read
# from bitsandbytes or nf4.py.
NF4_CODE = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0)
HALF_GAP = (NF4_CODE[1] - NF4_CODE[0]) / 2      # nearest-code rounding: 0.1519 x absmax
# The issue's table, odd shapes, a weight longer than one group of 256 blocks, one with a partial
# last block of 64.
SHAPES = [(96, 32), (32, 96), (128, 32), (64, 64), (96, 64), (3, 5), (7, 30), (1, 100), (33, 17),
          (257, 72), (130, 100)]
NATIVE = nf4.has_native_cpu_kernel()


def _weight(shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _block_ratio(w: torch.Tensor, dq: torch.Tensor) -> torch.Tensor:
    """Per block of 64 of the flattened weight: max |w - dq| / max |w| (the issue's table)."""
    pad = -w.numel() % 64
    err = torch.nn.functional.pad((w - dq).abs().reshape(-1), (0, pad)).view(-1, 64).amax(1)
    absmax = torch.nn.functional.pad(w.abs().reshape(-1), (0, pad)).view(-1, 64).amax(1)
    return err / absmax


def _scale_slack(w: torch.Tensor, state) -> torch.Tensor:
    """|absmax - stored absmax| / absmax per block: the double quantisation's share of the bound
    (the stored scale recomputed here from the QuantState's raw fields)."""
    pad = -w.numel() % 64
    absmax = torch.nn.functional.pad(w.abs().reshape(-1), (0, pad)).view(-1, 64).amax(1)
    nested = state.state2
    stored = torch.stack([nested.code[int(a)] * nested.absmax[i // 256]
                          for i, a in enumerate(state.absmax)]) + state.offset
    return (absmax - stored).abs() / absmax


@pytest.mark.parametrize("path", ["auto", "generic"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_round_trip_within_bound_on_both_paths(shape, path):
    w = _weight(shape)
    packed, state = nf4.quantize(w, check=False)
    assert state.shape == torch.Size(shape) and state.blocksize == 64 and state.nested
    assert torch.allclose(state.code, torch.tensor(NF4_CODE), atol=1e-7)
    dq = nf4.dequantize(packed, state, path)
    assert dq.shape == w.shape and dq.dtype == w.dtype
    ratio = _block_ratio(w, dq)
    assert (ratio <= (HALF_GAP + _scale_slack(w, state)) * (1 + 1e-5)).all(), ratio.max()
    # Nearest-code rounding alone allows 0.1519; the double-quantised scale adds its own error
    # (up to 0.02 x absmax for these weights). The broken per-row layout gave 0.40 to 1.07.
    assert ratio.max() < 0.16
    assert ratio.max() > 0.2 * HALF_GAP             # really quantised (15 values: one block)


def _flattened_kernel(packed, state):
    """Emulation of bitsandbytes' native CPU kernel on a CPU without AVX-512 (its scalar path):
    blocks over the flattened weight, which is what its generic kernel computes."""
    default_ops = pytest.importorskip("bitsandbytes.backends.default.ops")
    from bitsandbytes.backends.utils import _get_4bit_code

    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return default_ops._dequantize_4bit_compute(packed.reshape(-1), absmax,
                                                _get_4bit_code("nf4", packed.device), 64,
                                                state.shape, torch.float32).to(state.dtype)


def _row_blocked_kernel(packed, state):
    """Emulation of bitsandbytes' native CPU kernel on an AVX-512 CPU: blocks along each row."""
    return _per_row_layout(packed, state).to(state.dtype)


# Every kernel bitsandbytes can run on a CPU: this machine's (native with either path, or none)
# and the two native paths emulated, so each runs on every machine whatever its CPU.
KERNELS = {"machine": None, "emulated-flattened": _flattened_kernel,
           "emulated-row-blocked": _row_blocked_kernel}
EXPECTED_LAYOUT = {"emulated-flattened": "flattened", "emulated-row-blocked": "row-blocked"}
ISSUE_SHAPES = ((96, 32), (32, 96), (128, 32))  # rows of half a block or 1.5 blocks


@pytest.fixture(params=list(KERNELS))
def kernel(request, monkeypatch):
    """The name of the bitsandbytes CPU kernel under test; an emulation replaces the call nf4
    makes into bitsandbytes (its one seam, `_native_dequantize`)."""
    if KERNELS[request.param] is not None:
        monkeypatch.setattr(nf4, "has_native_cpu_kernel", lambda: True)
        monkeypatch.setattr(nf4, "_native_dequantize", KERNELS[request.param])
    return request.param


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_auto_path_equals_generic_on_every_kernel(kernel, shape):
    """The flattened call makes every kernel return exactly the generic result, whichever blocks
    the kernel forms for a 2-D shape."""
    w = _weight(shape)
    packed, state = nf4.quantize(w, check=False)
    assert torch.equal(nf4.dequantize(packed, state, "auto"),
                       nf4.dequantize(packed, state, "generic"))
    nf4.check_round_trip("w", w, packed, state, "auto")     # and the guard lets it through


def test_layout_probe_and_guard_agree_with_the_kernels_measured_error(kernel, monkeypatch):
    """The unfixed call (the weight's own 2-D shape, what bitsandbytes does by default) is
    measured here against the bound; the probe must name the kernel's layout from that, and the
    guard must refuse that call exactly when it is wrong. Which path ran is printed."""
    layout = nf4.native_layout()
    print(f"{kernel}: {nf4.describe_path('cpu', 'auto')}")
    assert layout in nf4.NATIVE_LAYOUTS and layout != "wrong"
    if kernel in EXPECTED_LAYOUT:
        assert layout == EXPECTED_LAYOUT[kernel]
    elif not NATIVE:
        assert layout == "none"
    cases = []
    for shape in ISSUE_SHAPES:
        w = _weight(shape)
        packed, state = nf4.quantize(w)                        # the project's path: checked
        unfixed = nf4._native_dequantize(packed, state)
        worst = float(_block_ratio(w, unfixed).max())
        if layout == "row-blocked":
            assert worst > 0.3, (shape, worst)                 # the bug, where it is detected
        else:
            assert worst < 0.16, (shape, worst)                # right: NF4 rounding only
        cases.append((w, packed, state, unfixed, worst))
    for w, packed, state, unfixed, worst in cases:
        monkeypatch.setattr(nf4, "dequantize", lambda p, s, path=None, out=unfixed: out)
        if worst > 0.16:
            with pytest.raises(nf4.NF4Error, match=r"native CPU kernel, blocks along each row"):
                nf4.check_round_trip("w", w, packed, state, "auto")
        else:
            nf4.check_round_trip("w", w, packed, state, "auto")


NO_NATIVE_LIBRARY = """
import ctypes
load = ctypes.cdll.LoadLibrary
def refuse(name, *args, **kwargs):
    if "libbitsandbytes_cpu" in str(name):
        raise OSError(f"{name}: refused (emulating a CPU without bitsandbytes' native library)")
    return load(name, *args, **kwargs)
ctypes.cdll.LoadLibrary = refuse
import torch
from megatron_longstraw.kernels import nf4
assert not nf4.has_native_cpu_kernel() and nf4.native_layout() == "none"
assert "no native CPU kernel" in nf4.describe_path("cpu", "auto")
for shape in [(96, 32), (32, 96), (7, 30), (130, 100)]:
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    packed, state = nf4.quantize(w)                     # checked against the bound
    assert torch.equal(nf4.dequantize(packed, state, "auto"), nf4.dequantize(packed, state, "generic"))
print("ok", nf4.describe_path("cpu", "auto"))
"""


def test_a_cpu_without_the_native_library_takes_the_generic_kernel():
    """bitsandbytes without its CPU library (other CPUs, a failed load) registers no native
    dequantize: its generic kernel runs, and the project's path is right there too."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", NO_NATIVE_LIBRARY], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and "ok bitsandbytes no native CPU kernel" in run.stdout, \
        run.stdout + run.stderr[-3000:]


def test_generic_equals_bitsandbytes_generic_kernel():
    """nf4's pure-PyTorch dequantise is bitsandbytes' own generic kernel, bitwise."""
    default_ops = pytest.importorskip("bitsandbytes.backends.default.ops")
    from bitsandbytes.backends.utils import _get_4bit_code

    for shape in SHAPES:
        w = _weight(shape, seed=1)
        packed, state = nf4.quantize(w, check=False)
        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        theirs = default_ops._dequantize_4bit_compute(packed.reshape(-1), absmax,
                                                      _get_4bit_code("nf4", w.device), 64,
                                                      state.shape, torch.float32)
        assert torch.equal(nf4.dequantize(packed, state, "generic"), theirs), shape


def test_bfloat16_and_float64_weights():
    for dtype in (torch.bfloat16, torch.float64):
        w = _weight((96, 32), seed=2).to(dtype)
        packed, state = nf4.quantize(w)                        # checked
        for path in ("auto", "generic"):
            dq = nf4.dequantize(packed, state, path).to(torch.float64)
            assert (_block_ratio(w.double(), dq) <= (HALF_GAP + _scale_slack(w.double(), state))
                    * (1 + 1e-5)).all()


def _per_row_layout(packed, state, path=None):
    """The broken layout: blocks of 64 along each row of [m, n], as bitsandbytes' native CPU kernel
    forms them (rows of 32 columns: half a block per row)."""
    m, n = state.shape
    codes = packed.reshape(-1)
    nibbles = torch.stack((codes >> 4, codes & 0xF), dim=1).reshape(-1)[:m * n].view(m, n)
    per_row = -(-n // 64)
    block = (torch.arange(m)[:, None] * per_row + torch.arange(n)[None] // 64)
    scales = nf4.block_absmax(state)
    return state.code[nibbles.long()] * scales[block.clamp_max(len(scales) - 1)]


@pytest.mark.usefixtures("single_process")
def test_guard_names_the_weight_when_the_layout_is_broken(monkeypatch):
    w = _weight((96, 32))
    packed, state = nf4.quantize(w)                            # the real path passes its check
    monkeypatch.setattr(nf4, "dequantize", _per_row_layout)
    with pytest.raises(nf4.NF4Error) as info:
        nf4.check_round_trip("decoder.layers.0.self_attention.linear_q_up_proj", w, packed, state)
    message = str(info.value)
    print(message)
    for part in ("decoder.layers.0.self_attention.linear_q_up_proj", "[96, 32]",
                 f"bitsandbytes {nf4.bitsandbytes_version()}", "path: ", "generic"):
        assert part in message, part
    # Through the adapters too: the layer that would train on wrong weights is refused.
    _, model = build_tiny_glm(torch.float32)
    with pytest.raises(nf4.NF4Error, match="linear_q_up_proj"):
        apply_lora(model, LoRAConfig(rank=4, targets=GLM52_TARGETS), quantize_base=True)


def test_env_selects_the_generic_path(monkeypatch):
    monkeypatch.setenv(nf4.ENV_PATH, "generic")
    assert nf4.describe_path("cpu") == "longstraw generic dequantize (pure PyTorch)"
    monkeypatch.setenv(nf4.ENV_PATH, "fast")
    with pytest.raises(ValueError, match="LONGSTRAW_NF4_DEQUANTIZE"):
        nf4.describe_path("cpu")


def test_matmul_forward_and_backward_equal_the_dequantised_linear():
    w = _weight((96, 32), seed=3)
    packed, state = nf4.quantize(w)
    dense = nf4.dequantize(packed, state, "generic")
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
    out = nf4.matmul(x, packed, state)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (gx,) = torch.autograd.grad(out, x, grad)
    x_ref = x.detach().clone().requires_grad_(True)
    ref = torch.nn.functional.linear(x_ref, dense)
    (gx_ref,) = torch.autograd.grad(ref, x_ref, grad)
    # Same dequantised weight, same fp32 GEMM shapes: fp32 rounding only.
    assert torch.allclose(out, ref, atol=1e-6, rtol=0) and torch.allclose(gx, gx_ref, atol=1e-6,
                                                                          rtol=0)


@pytest.mark.usefixtures("single_process")
def test_qlora_logits_equal_the_generic_dequantised_model():
    """The tiny GLM-5.2 has [96, 32] weights (the failing shape of the issue): its QLoRA
    forward equals the plain model whose targeted weights were replaced by the generic dequantise."""
    cfg, model = build_tiny_glm(torch.float32)
    _, reference = build_tiny_glm(torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(7))
    apply_lora(model, LoRAConfig(rank=4, targets=GLM52_TARGETS), quantize_base=True)
    shapes = set()
    with torch.no_grad():
        for name, module in lora_modules(model):
            weight = reference.get_submodule(name).weight
            weight.copy_(nf4.dequantize(module.nf4_weight, module.quant_state, "generic"))
            shapes.add(tuple(weight.shape))
        assert (96, 32) in shapes
        out, expected = model(ids[None], None, None), reference(ids[None], None, None)
    # Same weights; the GEMMs differ only in how they are grouped (dequantise + linear vs a plain
    # linear): fp32 rounding on logits of size ~1.
    assert (out - expected).abs().max() <= 1e-5
