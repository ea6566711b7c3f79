"""Tests for megatron_longstraw.state.pages.PageStore (CPU only; expected numbers computed by hand)."""

import pytest
import torch

from megatron_longstraw.state.pages import PageStore


def _rows(n: int, width: int = 576, start: float = 0.0) -> torch.Tensor:
    return torch.arange(n * width, dtype=torch.float32).reshape(n, width) + start


def test_append_across_page_boundaries_fetch_equals_concat():
    store = PageStore(page_tokens=4)
    a, b = _rows(3), _rows(6, start=10_000.0)
    store.append(0, "latent", a)
    store.append(0, "latent", b)
    assert store.num_tokens(0, "latent") == 9
    out = store.fetch(0, "latent")
    assert out.shape == (9, 576)
    assert torch.equal(out, torch.cat([a, b]))
    # row 3 is the first row of b and sits at offset 3 of page 0; row 4 starts page 1
    assert torch.equal(out[3], b[0]) and torch.equal(out[4], b[1]) and torch.equal(out[8], b[5])


def test_single_page_fetch_is_view_of_page():
    store = PageStore(page_tokens=8)
    store.append(0, "latent", _rows(5))
    out = store.fetch(0, "latent")
    assert out.shape == (5, 576)
    assert out.data_ptr() == store.fetch(0, "latent").data_ptr()  # no copy: same page storage


def test_bytes_exact_logical_and_allocated():
    store = PageStore(page_tokens=4)
    store.append(0, "latent", _rows(3))
    store.append(0, "latent", _rows(6))
    assert store.nbytes() == 9 * 576 * 4 == 20736
    assert store.nbytes(0, "latent") == 20736
    assert store.nbytes(allocated=True) == 3 * 4 * 576 * 4 == 27648
    assert store.bytes_by_kind() == {"latent": 20736}
    assert store.bytes_per_token() == 576 * 4


def test_mixed_kinds_and_layers():
    store = PageStore(page_tokens=4)
    for layer in (2, 0):
        store.append(layer, "latent", _rows(5, 576, start=layer))
        store.append(layer, "index_key", _rows(5, 128, start=-layer))
    store.put(1, "gdn_state", torch.ones(2, 3, 4))
    assert store.layers() == [0, 1, 2]
    assert store.kinds(2) == ["latent", "index_key"]
    assert store.kinds(1) == ["gdn_state"]
    assert torch.equal(store.fetch(2, "index_key"), _rows(5, 128, start=-2))
    assert torch.equal(store.fetch(0, "latent"), _rows(5, 576))
    # 2 layers * 5 tokens * 576 * 4 B; 2 * 5 * 128 * 4 B; 24 floats * 4 B
    assert store.bytes_by_kind() == {"latent": 23040, "index_key": 5120, "gdn_state": 96}
    assert store.fixed_kinds() == ["gdn_state"]  # latent / index_key grow with the tokens
    assert store.nbytes(layer_idx=2) == 5 * 576 * 4 + 5 * 128 * 4
    assert store.nbytes(kind="index_key", allocated=True) == 2 * 2 * 4 * 128 * 4
    # (576 + 128) * 4 bytes per token per layer, two layers
    assert store.bytes_per_token(["latent", "index_key"]) == 2 * (576 + 128) * 4
    assert store.bytes_per_token(["index_key"]) == 2 * 128 * 4
    store.append(0, "latent", _rows(1))
    with pytest.raises(ValueError):
        store.bytes_per_token(["latent"])  # layer 0 has 6 tokens, layer 2 has 5


def test_put_fetch_fixed_and_replace():
    store = PageStore(page_tokens=4)
    s1 = torch.full((3, 4), 2.0)
    store.put(0, "conv_tail", s1)
    s1.fill_(7.0)  # the store holds a copy
    assert torch.equal(store.fetch(0, "conv_tail"), torch.full((3, 4), 2.0))
    store.put(0, "conv_tail", torch.zeros(5, dtype=torch.float64))
    got = store.fetch(0, "conv_tail")
    assert got.shape == (5,) and got.dtype == torch.float64
    assert store.nbytes(0, "conv_tail") == 5 * 8
    assert store.nbytes(0, "conv_tail", allocated=True) == 40
    with pytest.raises(ValueError):
        store.num_tokens(0, "conv_tail")
    with pytest.raises(ValueError):
        store.append(0, "conv_tail", torch.zeros(1, 5))


def test_fixed_kinds_separate_fixed_from_sequence_bytes():
    # A Qwen3.6-like store: GDN layers 0 and 1 (state + conv tail), a K/V layer 3.
    store = PageStore(page_tokens=4)
    assert store.fixed_kinds() == []
    store.append(3, "key", _rows(6, 8))
    store.append(3, "value", _rows(6, 8))
    assert store.fixed_kinds() == []
    for layer in (1, 0):
        store.put(layer, "gdn_state", torch.zeros(2, 4, 4))
        store.put(layer, "conv_tail", torch.zeros(3, 10, dtype=torch.float64))
    assert store.fixed_kinds() == ["gdn_state", "conv_tail"]  # each once, layer 0's order
    by_kind = store.bytes_by_kind()
    fixed = sum(by_kind[k] for k in store.fixed_kinds())
    assert fixed == 2 * (32 * 4 + 30 * 8) == 736
    assert store.nbytes() - fixed == 2 * 6 * 8 * 4  # the K/V rows alone


def test_dtype_and_shape_mismatch_errors():
    store = PageStore(page_tokens=4)
    store.append(0, "k", torch.zeros(2, 8))
    with pytest.raises(ValueError, match="row shape"):
        store.append(0, "k", torch.zeros(2, 9))
    with pytest.raises(ValueError, match="dtype"):
        store.append(0, "k", torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError):
        store.append(0, "k", torch.tensor(1.0))  # no token dim
    with pytest.raises(KeyError):
        store.fetch(0, "v")
    assert store.num_tokens(0, "k") == 2  # failed appends left nothing behind


def test_storage_dtype_bf16_halves_bytes():
    x = torch.randn(6, 576)
    f32, bf16 = PageStore(page_tokens=4), PageStore(page_tokens=4, storage_dtype=torch.bfloat16)
    f32.append(0, "latent", x)
    bf16.append(0, "latent", x)
    assert f32.nbytes() == 6 * 576 * 4
    assert bf16.nbytes() == 6 * 576 * 2
    assert bf16.nbytes(allocated=True) == 2 * 4 * 576 * 2
    out = bf16.fetch(0, "latent")
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, x.to(torch.bfloat16))
    bf16.append(0, "latent", x[:1])  # validation is against the incoming (float32) dtype
    assert bf16.num_tokens(0, "latent") == 7


def test_iter_layers_order_and_fetch_cpu():
    store = PageStore(page_tokens=4)
    for layer in range(3):
        store.append(layer, "latent", torch.full((5, 2), float(layer)))
    seen = []
    for layer in store.iter_layers([2, 0, 1], "cpu"):
        seen.append(layer)
        assert torch.equal(store.fetch(layer, "latent", "cpu"), torch.full((5, 2), float(layer)))
    assert seen == [2, 0, 1]
    store.prefetch(0, "cpu")  # no-op on CPU
    store.release(0)
    assert torch.equal(store.fetch(0, "latent"), torch.zeros(5, 2))


def test_differentiable_reads_add_their_cotangents_to_the_page_buffer():
    store = PageStore(page_tokens=2)  # two pages: rows 0-1 and 2
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    store.append(0, "latent", x)
    store.put(0, "state", torch.tensor([1.0, -1.0]))
    assert store.grad(0, "latent") is None and not store.has_grad(0, "latent")
    store.keep_grads(["latent"])                     # no buffer for the other kind
    assert torch.equal(store.grad(0, "latent"), torch.zeros(3, 2)) and not store.has_grad(0, "state")
    w = torch.tensor([10.0, -1.0])
    whole = store.differentiable(store.fetch(0, "latent"), 0, "latent")
    assert not whole.is_leaf and whole.requires_grad
    ((whole * w).sum(dim=1) ** 2).sum().backward()   # d/dx[i, j] = 2 * (x_i . w) * w_j, x.w = [8, 26, 44]
    expected = torch.tensor([[160.0, -16.0], [520.0, -52.0], [880.0, -88.0]])
    assert torch.equal(store.grad(0, "latent"), expected)
    # Rows read by index (a sparse selection) add at those rows only; a second read adds again.
    rows = torch.tensor([0, 2])
    picked = store.differentiable(store.fetch(0, "latent")[rows], 0, "latent", rows=rows)
    (picked * torch.tensor([[1.0, 0.0], [0.0, 2.0]])).sum().backward()
    assert torch.equal(store.grad(0, "latent"), expected + torch.tensor([[1.0, 0], [0, 0], [0, 2.0]]))
    store.add_grad(0, "latent", torch.ones(1, 2), slice(1, 2))
    assert torch.equal(store.pop_grad(0, "latent")[1], expected[1] + 1)
    assert store.grad(0, "latent") is None
    assert torch.equal(store.fetch(0, "latent"), x)  # the pages themselves never change


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only default")
def test_pin_memory_none_resolves_false_without_cuda():
    store = PageStore(page_tokens=4)
    assert store.pin_memory is False
    store.append(0, "k", torch.ones(5, 3))
    assert not store.fetch(0, "k").is_pinned()
    with pytest.raises(ValueError):
        PageStore(pin_memory=True)


def test_clear_empties_and_bytes_zero():
    store = PageStore(page_tokens=4)
    store.append(0, "latent", _rows(9))
    store.put(1, "gdn_state", torch.ones(4))
    store.keep_grads()
    assert store.nbytes() == 9 * 576 * 4 + 16
    store.clear()
    assert store.nbytes() == 0 and store.nbytes(allocated=True) == 0
    assert store.layers() == [] and store.bytes_by_kind() == {}
    assert store.grad(0, "latent") is None
    with pytest.raises(KeyError):
        store.fetch(0, "latent")
    assert "layers=0" in repr(store)
