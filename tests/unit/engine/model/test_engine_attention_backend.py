"""Which attention path a runner takes: a pure function of device, dtype, block size and what is installed."""
import torch

from consort_engine.model import attention
from consort_engine.model.attention import choose_backend


def test_flash_only_for_half_precision_and_whole_256_token_pages(monkeypatch):
    monkeypatch.delenv("CONSORT_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", object())     # as if flash-attn were installed
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    monkeypatch.setattr(attention, "flash_capable", lambda device: True)
    cuda = torch.device("cuda")
    assert choose_backend(cuda, torch.bfloat16, 256) == "flash"
    assert choose_backend(cuda, torch.float16, 512) == "flash"
    # flash-attn has no fp32 kernels ("FlashAttention only support fp16 and bf16 data type")
    assert choose_backend(cuda, torch.float32, 256) == "triton"
    assert choose_backend(cuda, torch.bfloat16, 16) == "triton"       # paged KV in flash needs 256-token pages
    monkeypatch.setattr(attention, "flash_capable", lambda device: False)  # pre-Ampere: flash-attn 2 fails there
    assert choose_backend(cuda, torch.float16, 256) == "triton"
    monkeypatch.setattr(attention, "flash_capable", lambda device: True)
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    assert choose_backend(cuda, torch.float32, 256) == "torch"
    monkeypatch.setattr(attention, "flash_attn_varlen_func", None)
    assert choose_backend(cuda, torch.bfloat16, 256) == "torch"


def test_the_kv_cache_dtype_and_the_backend_that_reads_it(monkeypatch):
    import pytest

    from consort_engine.config import KV_CACHE_DTYPES
    from consort_engine.model.attention import FP8, kv_cache_dtype

    assert KV_CACHE_DTYPES == ("auto", *attention.KV_ELEMENTS)      # the CLI's choices are the elements
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        assert kv_cache_dtype("auto", dtype, cpu) == dtype
        assert kv_cache_dtype("fp8", dtype, cpu) == FP8
    assert kv_cache_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="one of auto"):
        kv_cache_dtype("int8", torch.float32, cpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))    # an A100
    assert kv_cache_dtype("bfloat16", torch.float16, cuda) == torch.bfloat16
    with pytest.raises(ValueError, match="8.9"):
        kv_cache_dtype("fp8", torch.bfloat16, cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))    # an H100 / H200
    assert kv_cache_dtype("fp8", torch.bfloat16, cuda) == FP8
    # flash-attn 2 reads the model's own dtype only: a narrower pool takes the Triton kernel
    monkeypatch.delenv("CONSORT_ATTENTION_BACKEND", raising=False)
    monkeypatch.setattr(attention, "flash_attn_varlen_func", object())
    monkeypatch.setattr(attention, "triton_available", lambda: True)
    monkeypatch.setattr(attention, "flash_capable", lambda device: True)
    assert choose_backend(cuda, torch.bfloat16, 256, torch.bfloat16) == "flash"
    assert choose_backend(cuda, torch.bfloat16, 256, FP8) == "triton"
    assert "flash-attn 2 reads a pool of the model's dtype" in attention.flash_refusal(cuda, torch.bfloat16, 256, FP8)
    monkeypatch.setattr(attention, "cpu_kernels", lambda: object())
    assert choose_backend(cpu, torch.bfloat16, 16, FP8) == "cpu_kernel"


def test_the_portable_path_stores_and_reads_an_fp8_pool():
    """The torch backend (CUDA without Triton, CONSORT_ATTENTION_BACKEND=torch): index_copy_ has no float8
    kernel, so the store copies bytes; decode reads what the pool holds, widened."""
    from consort_engine.model.attention import FP8, AttentionMetadata, PagedAttention

    g = torch.Generator().manual_seed(3)
    h, kvh, d, bs = 4, 2, 16, 4
    attn = PagedAttention(h, kvh, d, d ** -0.5, "torch")
    attn.k_cache, attn.v_cache = (torch.zeros(6, bs, kvh, d, dtype=FP8) for _ in range(2))
    ctx = 7                                                  # one sequence in blocks 3 and 1
    k, v = torch.randn(ctx, kvh, d, generator=g) * 3, torch.randn(ctx, kvh, d, generator=g)
    k[0, 0, 0] = 1000.0                                      # beyond e4m3's 448: saturates, as the C store does
    slots = torch.tensor([3 * bs + i for i in range(bs)] + [1 * bs + i for i in range(ctx - bs)])
    attn.store(k, v, slots)
    held_k = attn.k_cache.view(-1, kvh, d)[slots]
    assert torch.equal(held_k.view(torch.uint8), k.to(FP8).view(torch.uint8))
    assert held_k[0, 0, 0].float() == 448.0
    q = torch.randn(1, h, d, generator=g)
    meta = AttentionMetadata(slot_mapping=torch.tensor([-1]), num_batched_tokens=1,
                             block_tables=torch.tensor([[3, 1]], dtype=torch.int32),
                             context_lens=torch.tensor([ctx], dtype=torch.int32))
    out = attn._gathered_decode(q, meta, bs)
    kf, vf = held_k.float(), attn.v_cache.view(-1, kvh, d)[slots].float()
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), kf.transpose(0, 1).unsqueeze(0), vf.transpose(0, 1).unsqueeze(0),
        scale=d ** -0.5, enable_gqa=True)
    torch.testing.assert_close(out, ref[0].transpose(0, 1).reshape(1, -1), rtol=1e-5, atol=1e-5)
